#!/usr/bin/env bash
# Starts `prefixgate serve --replicas 1` on a free port, lists which ports its process tree
# (and the Redis it started) listens on and where, then stops it. docs/deploy.md's table.
#   bash infra/scripts/measure-listeners.sh              # loopback (the default --host)
#   bash infra/scripts/measure-listeners.sh --host 0.0.0.0
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
log=$(mktemp /tmp/prefixgate-listeners-XXXX.log)
port=$($PY -c "from gateway.local_redis import free_port; print(free_port())")
$PY -m gateway.cli serve --replicas 1 --port "$port" "$@" > "$log" 2>&1 &
pid=$!
for _ in $(seq 300); do
  grep -q "serving until" "$log" && break
  kill -0 "$pid" 2>/dev/null || { echo "serve exited; see $log"; exit 1; }
  sleep 1
done
$PY infra/scripts/listeners.py "$pid"
redis_port=$(sed -n 's/.*Redis: redis:\/\/127.0.0.1:\([0-9]*\).*/\1/p' "$log" | head -1)
[ -n "$redis_port" ] && ss -ltnH "sport = :$redis_port" | awk '{print "  redis-server " $4}'
kill -TERM "$pid"
for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
rm -f "$log"
