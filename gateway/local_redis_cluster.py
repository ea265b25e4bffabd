"""A private 3-master Redis Cluster on loopback ports (the tests, `prefixgate bench router --cluster`)."""

from __future__ import annotations

import random
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
        self.nodes = []
        while len(self.nodes) < masters:
            port = _cluster_port()
            if any(n.port == port for n in self.nodes):
                continue
            node = LocalRedis(port)
            node.extra_args = ("--cluster-enabled", "yes", "--cluster-config-file", str(node.dir / "nodes.conf"))
            self.nodes.append(node)

    @property
    def url(self) -> str:
        return self.nodes[0].url  # any node's URL names the whole cluster

    def start(self, timeout_s: float = 30.0) -> LocalRedisCluster:
        try:
            return self._start(timeout_s)
        except BaseException:  # a node that did not start: stop the ones that did
            self.cleanup()
            raise

    def _start(self, timeout_s: float) -> LocalRedisCluster:
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            node.start(max(1.0, deadline - time.monotonic()))
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
