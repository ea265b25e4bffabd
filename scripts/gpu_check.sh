#!/usr/bin/env bash
# Engine check on a CUDA machine: the Triton paged-attention kernels against the torch path,
# bf16 greedy parity with transformers on the tiny model families, then a nano-vllm-style
# throughput benchmark (random-weight Qwen3-0.6B, 256 seqs, prompts and outputs uniform in
# 100..1024 tokens). Prints output tok/s.
#
#   scripts/gpu_check.sh                     # on a machine with CUDA
#   scripts/gpu_check.sh --attention triton  # parity and throughput on the Triton kernels
#   scripts/gpu_check.sh --compile          # parity and throughput through the compiled forward
#   scripts/gpu_check.sh --smoke             # the same code paths, tiny, on CPU (run by the tests)
#   scripts/gpu_check.sh --json out.json     # extra arguments go to python -m loadtest.device.gpu_check
#
# Needs torch, transformers, triton and xxhash (no Ray, no Redis). PYTHON overrides the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
exec "$PYTHON" -m loadtest.device.gpu_check "$@"
