#!/usr/bin/env bash
# Starts the head's Redis (the routing index) locked down: a password generated here on the
# first run, bound to the cluster-internal address only, protected mode on, no persistence
# (replicas re-publish their block sets). Run by head_setup_commands; safe to run again.
#
# Writes ~/.prefixgate/ (mode 700), readable by this account only:
#   redis.env   PREFIXGATE_REDIS_PASSWORD / _HOST / _PORT, sourced before `ray start --head`:
#               the Serve config's redis_url names them (${VAR}, expanded when the app is built)
#   redis.conf  the server's config (requirepass): the password never appears on a command line
#
# Settings (environment, all optional):
#   PREFIXGATE_REDIS_BIND  address to listen on (default: the head's first address, `hostname -I`)
#   PREFIXGATE_REDIS_PORT  port (default 6379)
#
# With systemd as PID 1 and sudo, Redis runs as a systemd unit (restarted if it dies); without
# (containers, minimal VMs) it falls back to `redis-server --daemonize yes`, restarted by the
# next `ray up`. redis-server comes from apt when missing (needs root or passwordless sudo).
set -euo pipefail
umask 077
DIR=$HOME/.prefixgate
mkdir -p "$DIR" && chmod 700 "$DIR"
BIND=${PREFIXGATE_REDIS_BIND:-$(hostname -I 2>/dev/null | awk '{print $1}')}
PORT=${PREFIXGATE_REDIS_PORT:-6379}
log() { echo "[redis-start] $*" >&2; }
[ -n "$BIND" ] || { log "no address found: set PREFIXGATE_REDIS_BIND"; exit 1; }

SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
if ! command -v redis-server >/dev/null 2>&1; then
  log "installing redis-server (apt)"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
  # Debian's package starts its own server on 127.0.0.1:6379 where systemd runs: not ours.
  if [ "$(ps -p 1 -o comm= 2>/dev/null)" = systemd ]; then
    $SUDO systemctl disable --now redis-server >/dev/null 2>&1 || true
  fi
fi

# The password: generated once (hex: safe in a URL), kept across `ray up` runs.
if [ ! -s "$DIR/redis.env" ]; then
  PASSWORD=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
else
  PASSWORD=$(sed -n 's/^PREFIXGATE_REDIS_PASSWORD=//p' "$DIR/redis.env")
fi
cat > "$DIR/redis.env" <<ENV
PREFIXGATE_REDIS_PASSWORD=$PASSWORD
PREFIXGATE_REDIS_HOST=$BIND
PREFIXGATE_REDIS_PORT=$PORT
ENV
cat > "$DIR/redis.conf.new" <<CONF
bind $BIND
port $PORT
protected-mode yes
requirepass $PASSWORD
save ""
appendonly no
dir $DIR
pidfile $DIR/redis.pid
logfile $DIR/redis.log
CONF
chmod 600 "$DIR/redis.env" "$DIR/redis.conf.new"
answers() { [ "$(REDISCLI_AUTH=$PASSWORD redis-cli -h "$BIND" -p "$PORT" --no-auth-warning ping 2>/dev/null)" = PONG ]; }
# Same settings and already answering (e.g. `ray up --no-restart`): keep it, and the index.
if cmp -s "$DIR/redis.conf.new" "$DIR/redis.conf" && answers; then
  rm -f "$DIR/redis.conf.new"
  log "already running on $BIND:$PORT with these settings"
  exit 0
fi
mv "$DIR/redis.conf.new" "$DIR/redis.conf"

if [ "$(ps -p 1 -o comm= 2>/dev/null)" = systemd ] && $SUDO true 2>/dev/null; then
  $SUDO tee /etc/systemd/system/prefixgate-redis.service >/dev/null <<UNIT
[Unit]
Description=Redis for prefixgate's routing index
After=network-online.target
[Service]
User=$(id -un)
ExecStart=$(command -v redis-server) $DIR/redis.conf --daemonize no
Restart=always
RestartSec=1
[Install]
WantedBy=multi-user.target
UNIT
  $SUDO systemctl daemon-reload
  $SUDO systemctl enable prefixgate-redis >/dev/null 2>&1
  $SUDO systemctl restart prefixgate-redis
  log "running as systemd unit prefixgate-redis"
else
  # No systemd: stop our previous server by its pid, start a daemonized one.
  if [ -s "$DIR/redis.pid" ] && kill -0 "$(cat "$DIR/redis.pid")" 2>/dev/null; then
    pid=$(cat "$DIR/redis.pid"); kill "$pid"
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  fi
  redis-server "$DIR/redis.conf" --daemonize yes
  log "no systemd: redis-server daemonized (pid file $DIR/redis.pid)"
fi

# Ready when it answers PONG to an authenticated client (REDISCLI_AUTH: not on the command line).
for _ in $(seq 100); do
  if answers; then
    log "listening on $BIND:$PORT, password in $DIR/redis.env"
    exit 0
  fi
  sleep 0.1
done
log "redis-server did not answer on $BIND:$PORT; see $DIR/redis.log"
exit 1
