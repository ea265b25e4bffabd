#!/usr/bin/env bash
# Everything a lent CUDA machine runs, as one call (docs/benchmarks.md, "GPU check"): the
# kernel and bf16 parity checks with the engine's throughput on Qwen3-0.6B (scripts/gpu_check.sh),
# the replica's serving path on that engine (loadtest/device/stream_check.py), then the
# throughput on the Triton kernels. Each step has its own time limit, and a step that fails
# does not stop the next; the exit status says whether all passed.
#
#   scripts/device_check.sh OUTDIR      # logs and JSON reports go to OUTDIR
#
# The machine has torch, triton, transformers and xxhash but not msgspec: a wheel of it in
# .whl/ (python 3.12, see docs/benchmarks.md) is installed to a temporary folder first.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/device_check.sh OUTDIR}"
mkdir -p "$out"
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import msgspec" 2>/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/prefixgate-site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/prefixgate-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$out/gpu.txt"
status=0
step() {  # step NAME SECONDS ARGS...: one check, its log and its exit status
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit} s)"
  timeout "$limit" "$PYTHON" "$@" 2>&1 | grep -v -e '^Loading weights' -e '^Writing model' | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc"
  [ "$rc" -eq 0 ] || status=1
}
step gpu_check 210 -m loadtest.device.gpu_check --json "$out/gpu_check.json"
step stream_check 150 -m loadtest.device.stream_check --json "$out/stream_check.json"
step gpu_check_triton 110 -m loadtest.device.gpu_check --attention triton --skip-kernel --skip-parity \
  --json "$out/gpu_check_triton.json"
exit $status
