"""Two Ray nodes on this machine, prefixgate deployed across them, one session over HTTP.

Run by tests/test_infra.py in its own process (the other tests keep an in-process Ray; one
process cannot be the driver of two clusters). Writes a JSON report to --out, always, and
tears down everything it started, by process id: never `ray stop`, which would stop every
Ray on the machine, other people's included.

Layout: a head (gateway, Serve controller) and a worker that alone offers `replica_node`, so
the replicas can only run there. The replicas publish block hashes to a private Redis; the
router in the gateway's process (head) reads them to send turn 2 back to turn 1's replica.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, when run as a script

from gateway.config import AppConfig  # noqa: E402
from gateway.local_redis import LocalRedis, free_port  # noqa: E402
from router.protocol.redis_schema import RedisKeys  # noqa: E402

RAY = str(Path(sys.executable).with_name("ray"))
SYSTEM = (
    "You are a concise assistant for a travel agency. Answer in one short sentence, name the "
    "city or country you mean, and never invent prices, dates or opening hours. If you do not "
    "know, say so plainly and suggest where the traveller could look it up instead."
)
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[multinode {time.monotonic() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def become_subreaper() -> None:
    """Orphans of `ray start` (raylet, gcs_server, workers) re-parent to us, not to init, so
    children(recursive=True) finds every process this run caused."""
    PR_SET_CHILD_SUBREAPER = 36
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def node_ports() -> list[str]:
    # Every port Ray would otherwise take at a fixed default (10001, 52365, ...) gets a free
    # one, so this cluster never collides with another Ray on the machine.
    flags = ["--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
             "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port"]
    return [f"{flag}={free_port()}" for flag in flags]


class Cluster:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.temp_dir = workdir / "ray"
        self.gcs_port = free_port()
        self.address = f"127.0.0.1:{self.gcs_port}"
        token = workdir / "auth_token"
        token.write_text(secrets.token_hex(32))
        # Token auth as docs/environment.md says, but with our own token file: ~/.ray stays untouched.
        self.env = {
            **os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
            # Two cores shared with others: no idle Python workers started ahead of need.
            "RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        os.environ.update({k: self.env[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")})
        self.procs: dict[str, subprocess.Popen] = {}
        self.seen_pids: dict[int, float] = {}
        self.redis: LocalRedis | None = None
        self.stack = None

    def _start(self, name: str, args: list[str]) -> None:
        out = open(self.workdir / f"{name}.log", "w")
        # --block keeps `ray start` as the parent of its node's processes; SIGTERM to it stops
        # that node (Ray's own shutdown path for the node).
        self.procs[name] = subprocess.Popen([RAY, "start", "--block", *args], env=self.env, stdout=out,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def start(self, head_cpus: int, worker_cpus: int, replica_slots: int, timeout_s: float) -> None:
        self._start("head", [
            "--head", f"--port={self.gcs_port}", f"--num-cpus={head_cpus}", "--num-gpus=0",
            "--include-dashboard=false", f"--dashboard-port={free_port()}", f"--temp-dir={self.temp_dir}",
            f"--ray-client-server-port={free_port()}", "--disable-usage-stats", *node_ports(),
        ])
        self._wait_port(self.gcs_port, timeout_s)
        self._start("worker", [
            f"--address={self.address}", f"--num-cpus={worker_cpus}", "--num-gpus=0",
            f"--resources={json.dumps({'replica_node': replica_slots})}", *node_ports(),
        ])

    def _wait_port(self, port: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"ray start ({name}) exited with {p.returncode}: see {name}.log")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"GCS not listening on {port} after {timeout_s:.0f}s")

    def track(self) -> None:
        """Remember every descendant, and write (pid, start time) pairs to pids.json: if this
        process is killed before its teardown, the test stops exactly these."""
        for p in psutil.Process().children(recursive=True):
            try:
                self.seen_pids[p.pid] = p.create_time()
            except psutil.NoSuchProcess:
                pass
        (self.workdir / "pids.json").write_text(json.dumps(self.seen_pids))

    def stop(self, timeout_s: float = 60.0) -> list[int]:
        """SIGTERM each node's `ray start --block` (both at once: each takes ~10 s to stop its
        processes), then SIGKILL whatever of ours is still alive. Returns the pids still alive
        at the end (should be none)."""
        self.track()
        running = {name: p for name, p in self.procs.items() if p.poll() is None}
        for p in running.values():
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s / 2
        for name, p in running.items():
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
            log(f"{name} node stopped")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and self._alive():
            time.sleep(0.5)
        log(f"lingering: {[(pid, _name(pid)) for pid in self._alive()]}")
        for pid in self._alive():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
        self._reap()
        return self._alive()

    def _reap(self) -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    def _alive(self) -> list[int]:
        self._reap()
        alive = []
        for pid in sorted(set(self.seen_pids) | {c.pid for c in psutil.Process().children(recursive=True)}):
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        return alive


def _name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.NoSuchProcess:
        return "gone"


def chat(url: str, messages: list[dict], session: str) -> tuple[dict, httpx.Headers]:
    r = httpx.post(
        f"{url}/v1/chat/completions", headers={"x-session-id": session}, timeout=120,
        json={"model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": 8},
    )
    r.raise_for_status()
    return r.json(), r.headers


def run(args, cluster: Cluster, report: dict) -> None:
    import ray
    from ray import serve

    from gateway.stack import LocalStack

    # hang guards only, sized for a machine shared with another test worker (make test)
    cluster.start(head_cpus=4, worker_cpus=2, replica_slots=4, timeout_s=240)
    ray.init(address=cluster.address, log_to_driver=False)
    signal.signal(signal.SIGTERM, _interrupt)  # ray.init installed its own (sys.exit)
    deadline = time.monotonic() + 240
    while sum(n["Alive"] for n in ray.nodes()) < 2:
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker node did not join: {ray.nodes()}")
        time.sleep(0.5)
    nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    worker_id = next(i for i, n in nodes.items() if "replica_node" in n["Resources"])
    head_id = next(i for i in nodes if i != worker_id)
    report.update(head_node=head_id, worker_node=worker_id, t_cluster_s=round(time.monotonic() - T0, 1))
    log(f"cluster up: head {head_id[:8]}, worker {worker_id[:8]}")
    cluster.track()

    redis = cluster.redis = LocalRedis().start()
    key_prefix = f"mn-{secrets.token_hex(3)}"
    config = AppConfig(
        replicas=2, policy="prefix", redis_url=redis.url, key_prefix=key_prefix,
        kv_cache_mb=32, max_model_len=512, default_max_tokens=8,
        redis_timeout_s=1.0,  # a loaded machine must not turn turn 2's lookup into a `stale` fallback
        replica_resources={"replica_node": 1},
        # The gateway asks for more CPUs than the worker has (4 logical on the head, 2 on the
        # worker), which keeps it on the head: AppConfig has no placement option for it.
        gateway_num_cpus=3,
    )
    stack = cluster.stack = LocalStack(config, port=free_port(), ray_address=cluster.address)
    stack.start(timeout_s=args.deploy_timeout)
    report["t_deployed_s"] = round(time.monotonic() - T0, 1)
    log(f"serving at {stack.url}")
    cluster.track()

    details = serve.context._get_global_client().get_serve_details()
    deployments = details["applications"]["prefixgate"]["deployments"]
    report["replicas"] = {r["replica_id"]: r["node_id"] for r in deployments["PrefixCacheReplica"]["replicas"]}
    report["gateway_nodes"] = [r["node_id"] for r in deployments["Gateway"]["replicas"]]

    # Turn 1 (cold: "load"), then turn 2 of the same conversation, which extends turn 1's
    # prompt: the prefix policy can only pick turn 1's replica through its published hashes.
    session = f"mn-{secrets.token_hex(4)}"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]
    body1, h1 = chat(stack.url, messages, session)
    replica1 = h1["x-prefixgate-replica"]
    keys, client = RedisKeys(key_prefix), redis_client(redis.url)
    deadline = time.monotonic() + 10
    while client.scard(keys.blocks(replica1)) == 0 and time.monotonic() < deadline:
        time.sleep(0.1)  # the publisher flushes every 20 ms; don't race it
    report["published_blocks"] = {rid: client.scard(keys.blocks(rid)) for rid in report["replicas"]}
    messages += [{"role": "assistant", "content": body1["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And of Italy?"}]
    body2, h2 = chat(stack.url, messages, session)
    report["turns"] = [
        {"replica": h["x-prefixgate-replica"], "route": h["x-prefixgate-route"], "usage": b["usage"]}
        for b, h in ((body1, h1), (body2, h2))
    ]
    metrics = httpx.get(f"{stack.url}/metrics", timeout=10).text
    report["route_metrics"] = [ln for ln in metrics.splitlines() if ln.startswith("prefixgate_route_decisions_total{")]
    log(f"turns: {report['turns']}")


def redis_client(url: str):
    import redis

    return redis.Redis.from_url(url, socket_timeout=2)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--workdir", required=True, help="an empty directory with a short path (Ray's socket paths)")
    p.add_argument("--deploy-timeout", type=float, default=150)
    args = p.parse_args()
    become_subreaper()
    workdir = Path(args.workdir)
    cluster = Cluster(workdir)
    report: dict = {"workdir": str(workdir), "ok": False}
    signal.signal(signal.SIGTERM, _interrupt)  # the test's timeout: teardown must still run
    try:
        run(args, cluster, report)
        report["ok"] = True
    except BaseException as e:  # noqa: BLE001 - any failure must still reach teardown and the report
        report["error"] = "".join(traceback.format_exception(e))
        log(f"failed: {e!r}")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut teardown short
        t = time.monotonic()
        try:
            disconnect(cluster)
        except Exception as e:  # noqa: BLE001
            report.setdefault("teardown_errors", []).append(repr(e))
        log("driver disconnected")
        if cluster.redis is not None:
            cluster.redis.cleanup()
        report["pids_seen"] = len(cluster.seen_pids)
        report["left_alive"] = cluster.stop()
        report["t_teardown_s"] = round(time.monotonic() - t, 1)
        report["t_total_s"] = round(time.monotonic() - T0, 1)
        ok = report["ok"] and not report["left_alive"]
        Path(args.out).write_text(json.dumps(report, indent=1))
        log(f"done in {report['t_total_s']}s; left alive: {report['left_alive']}")
    return 0 if ok else 1


def _interrupt(*_) -> None:
    raise KeyboardInterrupt("SIGTERM")


def disconnect(cluster: Cluster) -> None:
    """The driver's side: Serve's actors, then our connection. The nodes stop in Cluster.stop."""
    import ray

    if not ray.is_initialized():
        return
    if cluster.stack is not None:
        cluster.stack.stop()  # serve.shutdown() + ray.shutdown()
    else:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
