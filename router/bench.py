"""`prefixgate bench router`: cost of one routing decision, Redis round trip included.

Publishes N block hashes (default 100k) for R replicas into a private redis-server, then times
what PrefixGateRouter does per request: chain-hash the prompt's token ids, one scripted lookup
(session + every replica's leading-block match + heartbeats), and the affinity policy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time

import redis

from gateway.local_redis import LocalRedis
from router.policy import ReplicaView, RouteRequest, make_policy
from router.protocol.hashing import block_hashes, chain_seed
from router.protocol.redis_schema import RedisKeys
from router.redis_index import RedisConfig, RedisIndex


def populate(url: str, keys: RedisKeys, replicas: list[str], total: int, prompts: list[list[int]], seed: int) -> None:
    """Each replica holds its share of random hashes plus the chains of some real prompts."""
    client = redis.Redis.from_url(url)
    rng = random.Random(seed)
    pipe = client.pipeline(transaction=False)
    per = total // len(replicas)
    for i, rid in enumerate(replicas):
        hashes = [rng.getrandbits(64) for _ in range(per)]
        for j in range(0, per, 10_000):
            pipe.sadd(keys.blocks(rid), *hashes[j : j + 10_000])
        for p in prompts[i :: len(replicas)]:
            pipe.sadd(keys.blocks(rid), *block_hashes(p, 16, chain_seed("bench")))
        pipe.hset(keys.heartbeat(rid), mapping={"running": i % 3, "waiting": 0, "pending_prefill_tokens": 100 * i,
                                                "free_blocks": 100, "cached_blocks": 900, "capacity_blocks": 1000})
        pipe.sadd(keys.replicas, rid)
    pipe.execute()
    print(f"published {client.dbsize()} keys, {sum(client.scard(keys.blocks(r)) for r in replicas)} block hashes")


async def measure(url: str, replicas: list[str], prompts: list[list[int]], iterations: int) -> list[float]:
    index = RedisIndex(RedisConfig(url, "bench", timeout_s=0.5))
    policy = make_policy("affinity", seed=0)
    seed = chain_seed("bench")
    timings = []
    for i in range(iterations + 50):
        tokens = prompts[i % len(prompts)]
        start = time.perf_counter()
        hashes = block_hashes(tokens, 16, seed)
        look = await index.lookup(hashes, replicas, f"session-{i % 100}")
        views = [ReplicaView(rid, e.matched_blocks, **e.heartbeat)
                 for rid, e in look.replicas.items()]
        policy.choose(RouteRequest(hashes, len(tokens), 16, f"session-{i % 100}"), views, look.session_replica)
        if i >= 50:  # warm-up excluded
            timings.append(time.perf_counter() - start)
    await index.close()
    return timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefixgate bench router", description=__doc__)
    parser.add_argument("--blocks", type=int, default=100_000, help="block hashes published in all")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="prompt length (64 blocks of 16)")
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(50_000) for _ in range(args.prompt_tokens)] for _ in range(64)]
    replicas = [f"r{i}" for i in range(args.replicas)]
    server = LocalRedis().start()
    try:
        populate(server.url, RedisKeys("bench"), replicas, args.blocks, prompts, 0)
        timings = asyncio.run(measure(server.url, replicas, prompts, args.iterations))
    finally:
        server.cleanup()
    ms = sorted(t * 1000 for t in timings)
    result = {
        "replicas": args.replicas, "blocks": args.blocks, "prompt_tokens": args.prompt_tokens,
        "p50_ms": statistics.median(ms), "p99_ms": ms[int(0.99 * (len(ms) - 1))], "max_ms": ms[-1],
    }
    print(f"routing decision ({args.prompt_tokens}-token prompt, {args.replicas} replicas, {args.blocks} published blocks): "
          f"p50 {result['p50_ms']:.3f} ms, p99 {result['p99_ms']:.3f} ms, max {result['max_ms']:.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
