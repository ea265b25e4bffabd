"""What routing without the index keeps of the cache: `stale` decisions against blind ones.

One local stack (Redis, Ray Serve), three apps of `--replicas` sim-compute replicas each (the
real BlockManager and usage accounting, cold caches, own key prefixes), the same chat load on
each: sessions of several turns, each opening with one of a few shared system prompts.
- `index`: affinity with the Redis index (the normal path);
- `stale`: affinity whose every lookup times out (`redis_timeout_s` 0: asyncio.wait_for with
  no time at all, so the router's Redis calls always fail while the replicas still publish and
  the load table still refreshes): each decision is `stale`, made from the router's own memory;
- `blind`: consistent hashing on the session (policy `session`), what the router did without
  the index before `stale` decisions existed (route reason `fallback`).
Reports the prompt tokens served from cache (sum of cached_tokens / sum of prompt tokens) and
the routes seen. Hit rate only: no timing, so the machine's load does not bias it.

    flock /tmp/prefixgate-heavy.lock python scripts/bench_stale_routing.py --replicas 4 --sessions 32 --turns 4
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import uuid
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.config import AppConfig  # noqa: E402
from gateway.local_redis import free_port  # noqa: E402
from gateway.stack import LocalStack  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["ships and harbours", "trains and timetables", "tax returns", "garden plants", "chess openings",
          "bread baking", "bicycle repair", "star charts"]


def system_prompt(i: int) -> str:
    return f"You are assistant number {i}. You answer questions about {TOPICS[i % len(TOPICS)]}. " * 6


async def session(http: httpx.AsyncClient, base: str, sid: str, system: str, turns: int, rng: random.Random,
                  totals: Counter, routes: Counter) -> None:
    messages = [{"role": "system", "content": system}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Question {t} of {sid}: {rng.randrange(10**6)}?"})
        r = await http.post(f"{base}/v1/chat/completions", headers={"x-session-id": sid},
                            json={"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0})
        r.raise_for_status()
        usage = r.json()["usage"]
        totals["prompt"] += usage["prompt_tokens"]
        totals["cached"] += usage["prompt_tokens_details"]["cached_tokens"]
        routes[r.headers["x-prefixgate-route"]] += 1
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})


async def load(base: str, args) -> tuple[Counter, Counter]:
    totals, routes = Counter(), Counter()
    rng = random.Random(args.seed)
    plan = [(f"s{i}-{uuid.uuid4().hex[:4]}", system_prompt(rng.randrange(args.systems))) for i in range(args.sessions)]
    sem = asyncio.Semaphore(args.concurrency)

    async def one(sid, system):
        async with sem:
            await session(http, base, sid, system, args.turns, random.Random(sid), totals, routes)

    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(*(one(sid, system) for sid, system in plan))
    return totals, routes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--systems", type=int, default=4, help="distinct system prompts the sessions share")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    variants = {
        "index": {"policy": "affinity"},
        "stale": {"policy": "affinity", "redis_timeout_s": 0.0},
        "blind": {"policy": "session"},
    }
    base_config = dict(engine="sim", replicas=args.replicas, default_max_tokens=16, redis_url="auto")
    stack = LocalStack(AppConfig(key_prefix="stale-warm", **base_config), port=free_port()).start()
    results = {}
    try:
        from ray import serve

        serve.delete("prefixgate")  # the stack's own app: not measured
        for name, extra in variants.items():
            config = AppConfig(**{**base_config, "redis_url": stack.config.redis_url},
                               key_prefix=f"stale-{name}-{uuid.uuid4().hex[:6]}", **extra)
            base = stack.deploy(config, name=f"bench-{name}", route_prefix=f"/{name}")
            results[name] = asyncio.run(load(base, args))
            serve.delete(f"bench-{name}")
    finally:
        stack.stop()
    print(f"{args.sessions} sessions x {args.turns} turns, {args.systems} shared system prompts, "
          f"{args.replicas} sim replicas each, concurrency {args.concurrency}")
    for name, (totals, routes) in results.items():
        rate = totals["cached"] / max(totals["prompt"], 1)
        print(f"{name:6s}: cached {totals['cached']:6d} of {totals['prompt']:6d} prompt tokens = {rate:6.1%}   "
              f"routes {dict(sorted(routes.items()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
