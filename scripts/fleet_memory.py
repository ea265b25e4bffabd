"""Start N sim replicas + K gateways on this machine, time the start, measure every process.

    flock /tmp/prefixgate-heavy.lock .venv/bin/python scripts/fleet_memory.py --replicas 32 --gateways 2

Prints one JSON object: seconds until the app answered and until every replica ran, RSS/PSS/USS
(MB) per sim replica and per gateway, whether any of them mapped torch, a few chat and token-id
requests' cached tokens and routes, and the replicas' step lag.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from gateway.config import AppConfig  # noqa: E402
from gateway.local_redis import LocalRedis, free_port  # noqa: E402
from gateway.procstats import proc_memory, serve_replica_pids, summary  # noqa: E402
from gateway.stack import APP_NAME, LocalStack  # noqa: E402
from replica.default_model import DEFAULT_MODEL_NAME  # noqa: E402


def wait_running(replicas: int, gateways: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (len(serve_replica_pids(APP_NAME, "PrefixCacheReplica")) >= replicas
                and len(serve_replica_pids(APP_NAME, "Gateway")) >= gateways):
            from ray import serve

            if str(serve.status().applications[APP_NAME].status).endswith("RUNNING"):
                return
        time.sleep(0.5)
    raise TimeoutError("replicas did not all start")


def bare_actor_memory() -> dict:
    """An empty Ray actor on the same node: the floor any replica process pays."""
    import ray

    @ray.remote(num_cpus=0)
    class Bare:
        def pid(self) -> int:
            import os

            return os.getpid()

    actor = Bare.remote()
    try:
        m = proc_memory(ray.get(actor.pid.remote(), timeout=60))
        return {"rss_mb": round(m.rss_mb, 1), "pss_mb": round(m.pss_mb, 1), "uss_mb": round(m.uss_mb, 1)}
    finally:
        ray.kill(actor)


def bare_serve_replica_memory() -> dict:
    """An empty Serve deployment's replica: the floor of any Serve replica process."""
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Bare:
        def pid(self) -> int:
            import os

            return os.getpid()

    handle = serve.run(Bare.bind(), name="bare", route_prefix="/bare-floor")
    try:
        m = proc_memory(handle.pid.remote().result(timeout_s=60))
        return {"rss_mb": round(m.rss_mb, 1), "pss_mb": round(m.pss_mb, 1), "uss_mb": round(m.uss_mb, 1)}
    finally:
        serve.delete("bare")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=32)
    p.add_argument("--gateways", type=int, default=2)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    redis = LocalRedis().start()
    config = AppConfig(
        redis_url=redis.url, key_prefix=f"fleet-{uuid.uuid4().hex[:6]}", replicas=args.replicas,
        gateways=args.gateways, engine="sim", num_blocks=args.num_blocks, default_max_tokens=16,
        max_model_len=4096,
    )
    stack = LocalStack(config, port=free_port())
    out: dict = {"replicas": args.replicas, "gateways": args.gateways}
    t0 = time.monotonic()
    try:
        stack.start(timeout_s=args.timeout)
        out["answering_s"] = round(time.monotonic() - t0, 1)
        wait_running(args.replicas, args.gateways, args.timeout)
        out["all_running_s"] = round(time.monotonic() - t0, 1)
        turns = []
        history = [{"role": "system", "content": "You are a terse assistant. " * 20}]
        for i in range(3):
            history.append({"role": "user", "content": f"Question {i}: tell me about fleets."})
            r = httpx.post(f"{stack.url}/v1/chat/completions", timeout=60, headers={"x-session-id": "s1"},
                           json={"model": DEFAULT_MODEL_NAME, "messages": history, "max_tokens": 8})
            r.raise_for_status()
            body = r.json()
            history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
            turns.append({"cached": body["usage"]["prompt_tokens_details"]["cached_tokens"],
                          "prompt": body["usage"]["prompt_tokens"], "route": r.headers.get("x-prefixgate-route")})
        out["chat_turns"] = turns
        reps = [proc_memory(pid) for pid in serve_replica_pids(APP_NAME, "PrefixCacheReplica")]
        gws = [proc_memory(pid) for pid in serve_replica_pids(APP_NAME, "Gateway")]
        out["sim_replica_mb"] = summary(reps)
        out["gateway_mb"] = summary(gws)
        out["bare_ray_actor_mb"] = bare_actor_memory()
        out["bare_serve_replica_mb"] = bare_serve_replica_memory()
        mem = Path("/proc/meminfo").read_text().split("\n")
        out["meminfo"] = [line for line in mem if line.startswith(("MemTotal", "MemAvailable"))]
    finally:
        stack.stop()
        redis.cleanup()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
