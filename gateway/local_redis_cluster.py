"""A private 3-master Redis Cluster on loopback ports (the tests, `prefixgate bench router --cluster`)."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time

import redis
from redis.cluster import RedisCluster

from gateway.local_redis import LocalRedis


def _cluster_port() -> int:
    """A free port whose cluster-bus port (port + 10000) is free and valid too; both below
    Linux's ephemeral range (32768+), so no outgoing connection can take them meanwhile."""
    for _ in range(200):
        port = random.randrange(20000, 22700)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class LocalRedisCluster:
    def __init__(self, masters: int = 3) -> None:
        self.nodes = [LocalRedis(_cluster_port()) for _ in range(masters)]

    @property
    def url(self) -> str:
        return self.nodes[0].url  # any node's URL names the whole cluster

    def start(self, timeout_s: float = 30.0) -> LocalRedisCluster:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        for node in self.nodes:
            subprocess.run(
                [binary, "--port", str(node.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--cluster-enabled", "yes", "--cluster-config-file", str(node.dir / "nodes.conf"),
                 "--daemonize", "yes", "--pidfile", str(node.pidfile), "--dir", str(node.dir),
                 "--logfile", str(node.dir / "redis.log")],
                check=True,
            )
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            client = redis.Redis(port=node.port, socket_timeout=0.5)
            while True:
                try:
                    if client.ping() and node.pidfile.exists():
                        node.pid = int(node.pidfile.read_text().strip())
                        break
                except (redis.ConnectionError, redis.TimeoutError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cluster node on port {node.port} did not start")
                time.sleep(0.05)
        subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout_s,
        )
        client = redis.Redis(port=self.nodes[0].port, socket_timeout=0.5, decode_responses=True)
        while client.cluster("info").get("cluster_state") != "ok":
            if time.monotonic() > deadline:
                raise TimeoutError("cluster did not reach state ok")
            time.sleep(0.1)
        return self

    def client(self) -> RedisCluster:
        return RedisCluster(host="127.0.0.1", port=self.nodes[0].port, decode_responses=True)

    def commandstats(self) -> dict[str, dict[str, float]]:
        """INFO commandstats summed over the masters."""
        total: dict[str, dict[str, float]] = {}
        for node in self.nodes:
            stats = redis.Redis(port=node.port).info("commandstats")
            for name, v in stats.items():
                t = total.setdefault(name, {"calls": 0, "usec": 0})
                t["calls"] += v["calls"]
                t["usec"] += v["usec"]
        return total

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()
