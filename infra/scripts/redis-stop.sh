#!/usr/bin/env bash
# Stops the head's Redis that redis-start.sh started (`ray down` stops Ray only). The password
# file stays, so the next `ray up` keeps the same password; delete ~/.prefixgate to rotate it.
set -euo pipefail
DIR=$HOME/.prefixgate
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
if [ -f /etc/systemd/system/prefixgate-redis.service ] && [ "$(ps -p 1 -o comm= 2>/dev/null)" = systemd ]; then
  $SUDO systemctl disable --now prefixgate-redis
elif [ -s "$DIR/redis.pid" ] && kill -0 "$(cat "$DIR/redis.pid")" 2>/dev/null; then
  pid=$(cat "$DIR/redis.pid"); kill "$pid"
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid"; fi
fi
echo "[redis-stop] stopped" >&2
