#!/usr/bin/env bash
# The suite as CI and a new user see it, under stress: a fresh clone of this repository's main
# beside ../shared, its own install, then `make test`, optionally with a competing CPU hog
# pinned to one core and/or in a shuffled order (pytest-randomly). docs/reliability.md keeps
# the runs' results.
#
#   scripts/stress_suite.sh                 # fresh clone, plain `make test`
#   scripts/stress_suite.sh --hog           # ... with a busy loop on core 0 for the whole run
#   scripts/stress_suite.sh --shuffle 1234  # ... in the order pytest-randomly's seed 1234 gives
#
# The hog is bounded (it stops by itself after 2 hours) and is stopped when the run ends.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
hog=0; shuffle=""; dir=""
while [ $# -gt 0 ]; do
  case "$1" in
    --hog) hog=1 ;;
    --shuffle) shuffle="${2:-$RANDOM}"; shift ;;
    --dir) dir="$2"; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
dir="${dir:-$(dirname "$repo")/prefixgate-stress-$(date +%s)}"
git clone -q --branch main "$repo" "$dir"
cd "$dir"
make install >/dev/null
args="-p no:randomly"
[ -n "$shuffle" ] && args="--randomly-seed=$shuffle"
hog_pid=""
cleanup() { [ -n "$hog_pid" ] && kill "$hog_pid" 2>/dev/null || true; }
trap cleanup EXIT
if [ "$hog" = 1 ]; then
  taskset -c 0 timeout 7200 python3 -c 'while True: pass' &
  hog_pid=$!
fi
start=$(date +%s)
status=0
make test PYTEST_ARGS="$args -rf" || status=$?
echo "[stress] $(git rev-parse --short HEAD) hog=$hog shuffle=${shuffle:-no} exit=$status in $(( $(date +%s) - start )) s ($dir)"
exit $status
