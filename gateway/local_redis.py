"""Starts and stops a private redis-server on a loopback port (for `make run` and the tests)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """n distinct free ports: all held bound until each is read (free_port called n times can
    hand the same port out twice, since each is released before the next is asked for)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def port_in_use(host: str, port: int) -> bool:
    """Whether something already listens on (host, port): a stack refuses to start there rather
    than fail half-way up when Serve cannot bind it."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


class LocalRedis:
    def __init__(self, port: int | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        self.extra_args = extra_args  # e.g. a cluster node's flags (gateway/local_redis_cluster.py)
        self.dir = Path(tempfile.mkdtemp(prefix="prefixgate-redis-"))
        self.pidfile = self.dir / "redis.pid"
        self.pid: int | None = None
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        # A child of ours (its pid known the moment it exists, so a stop at any point finds it),
        # in a session of its own (a terminal's Ctrl-C reaches us, and we stop it in order).
        self._proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--daemonize", "no", "--pidfile", str(self.pidfile), "--dir", str(self.dir),
             "--logfile", str(self.dir / "redis.log"), *self.extra_args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        self.pid = self._proc.pid
        client = redis.Redis(port=self.port, socket_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if (code := self._proc.poll()) is not None:
                    self._proc = self.pid = None
                    raise RuntimeError(f"redis-server exited with {code} on port {self.port} "
                                       f"(log: {self.dir / 'redis.log'})")
                try:
                    if client.ping():
                        return self
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
                time.sleep(0.05)
        finally:
            client.close()
        self.stop()
        raise TimeoutError(f"redis-server did not start on port {self.port}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after timeout_s; returns once the process is gone (reaped)."""
        proc, self._proc, self.pid = self._proc, None, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
