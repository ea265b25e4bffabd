"""`prefixgate bench router`: cost of one routing decision, Redis included, at several fleet
sizes measured side by side in one run.

For each fleet size R, B block hashes are published into the inverted index (a private
redis-server, or a private 3-master Redis Cluster with --cluster): a system prompt every replica
holds, then each prompt's own blocks on a few replicas, then random blocks up to B. The timed
loop alternates between the fleet sizes (so machine noise hits them alike) and does what the
router does per request: chain-hash the prompt, look it up, score the matched + sampled
replicas with the affinity policy (router.decider, the code the router runs). Redis commands
and Redis CPU per decision come from INFO commandstats deltas (commands run inside the lookup
script are counted too); the load table's background refresh is reported apart.
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
from router.decider import Decider, InflightPrefixes
from router.index.redis_index import RedisConfig, RedisIndex
from router.load_table import LoadTable
from router.policy import RouteRequest, make_policy
from router.protocol.hashing import block_hashes, chain_seed
from router.protocol.redis_schema import RedisKeys

BLOCK = 16
SYSTEM_TOKENS = 256  # shared by every prompt, held by every replica: the hot prefix


def _client(url: str, cluster: bool):
    if cluster:
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(url.rsplit("/", 1)[0])
    return redis.Redis.from_url(url)


def populate(client, keys: RedisKeys, replicas: list[str], total: int, prompts: list[list[int]], seed: int) -> int:
    """Publishes `total` blocks into the inverted index and the per-replica sets."""
    rng = random.Random(seed)
    held: dict[str, list[int]] = {r: [] for r in replicas}
    chain_seed_ = chain_seed("bench")
    system = block_hashes(prompts[0][:SYSTEM_TOKENS], BLOCK, chain_seed_)
    for r in replicas:
        held[r] += system
    for i, p in enumerate(prompts):
        own = block_hashes(p, BLOCK, chain_seed_)[len(system):]
        for k in range(3):  # each conversation lives on a few replicas
            held[replicas[(i + k * 7) % len(replicas)]] += own
    published = sum(len(v) for v in held.values())
    per = max(0, (total - published) // len(replicas))
    for r in replicas:
        held[r] += [rng.getrandbits(64) for _ in range(per)]
    pipe = client.pipeline(transaction=False)
    n = 0
    for r, hashes in held.items():
        for h in hashes:
            pipe.sadd(keys.block(h), r)
            n += 1
            if n % 20_000 == 0:
                pipe.execute()
        for j in range(0, len(hashes), 10_000):
            pipe.sadd(keys.blocks(r), *hashes[j : j + 10_000])
        pipe.hset(keys.heartbeat(r), mapping={"running": 1, "waiting": 0, "pending_prefill_tokens": 100,
                                              "free_blocks": 100, "cached_blocks": 900, "capacity_blocks": 1000})
        pipe.sadd(keys.replicas, r)
    pipe.execute()
    return sum(len(v) for v in held.values())


def commandstats(nodes: list[redis.Redis]) -> dict[str, dict[str, float]]:
    total: dict[str, dict[str, float]] = {}
    for node in nodes:
        for name, v in node.info("commandstats").items():
            t = total.setdefault(name.removeprefix("cmdstat_"), {"calls": 0, "usec": 0})
            t["calls"] += v["calls"]
            t["usec"] += v["usec"]
    return total


def delta(after: dict, before: dict) -> dict[str, dict[str, float]]:
    out = {}
    for name, v in after.items():
        b = before.get(name, {"calls": 0, "usec": 0})
        calls, usec = v["calls"] - b["calls"], v["usec"] - b["usec"]
        if calls:
            out[name] = {"calls": calls, "usec": usec}
    return out


class Fleet:
    """One fleet size: its index, load table and decider, as a router holds them."""

    def __init__(self, url: str, prefix: str, replicas: list[str]) -> None:
        self.replicas = replicas
        self.index = RedisIndex(RedisConfig(url, prefix, timeout_s=0.5))
        self.loads = LoadTable(self.index, refresh_s=0.1, seed=0)
        self.decider = Decider(make_policy("affinity", seed=0), self.loads, InflightPrefixes(3.0), sampled=4)
        self.timings: list[float] = []
        self.scored: list[int] = []

    async def decide(self, tokens: list[int], session: str, record: bool) -> None:
        start = time.perf_counter()
        hashes = block_hashes(tokens, BLOCK, chain_seed("bench"))
        look = await self.index.lookup(hashes, None, session)
        route = RouteRequest(hashes, len(tokens), BLOCK, session)
        routed = self.decider.score(route, self.replicas, look, lambda rid: 0)
        if record:
            self.timings.append(time.perf_counter() - start)
            self.scored.append(len(routed.ranked))


async def measure(url: str, fleets: dict[int, Fleet], prompts: list[list[int]], iterations: int, nodes) -> dict:
    for fleet in fleets.values():  # warm-up: connections, scripts, first load-table refresh
        for i in range(50):
            await fleet.decide(prompts[i % len(prompts)], f"s{i}", record=False)
        await fleet.loads.refresh()
    results = {}
    per_fleet_stats = {r: {} for r in fleets}
    for i in range(iterations):
        for r, fleet in fleets.items():  # side by side: alternate the fleet sizes
            before = commandstats(nodes) if i % 50 == 0 else None
            await fleet.decide(prompts[i % len(prompts)], f"session-{i % 100}", record=True)
            if before is not None:  # a sample of single decisions, each isolated by INFO calls
                d = delta(commandstats(nodes), before)
                d.pop("info", None)
                for name, v in d.items():
                    t = per_fleet_stats[r].setdefault(name, {"calls": 0, "usec": 0, "n": 0})
                    t["calls"] += v["calls"]
                    t["usec"] += v["usec"]
                samples = per_fleet_stats[r].setdefault("_samples", {"n": 0})
                samples["n"] += 1
    for r, fleet in fleets.items():
        ms = sorted(t * 1000 for t in fleet.timings)
        stats = per_fleet_stats[r]
        n = stats.pop("_samples")["n"]
        background = {k: v for k, v in stats.items() if k in ("hmget",)}  # the load table's refresh
        decision = {k: v for k, v in stats.items() if k not in background}
        # commands inside the script are counted on their own AND within EVALSHA's usec
        cpu = sum(v["usec"] for k, v in decision.items() if k in ("evalsha", "get", "eval"))
        results[r] = {
            "replicas": r,
            "p50_ms": round(statistics.median(ms), 4),
            "p99_ms": round(ms[int(0.99 * (len(ms) - 1))], 4),
            "max_ms": round(ms[-1], 4),
            "redis_commands_per_decision": round(sum(v["calls"] for v in decision.values()) / n, 2),
            "redis_commands_by_name": {k: round(v["calls"] / n, 2) for k, v in sorted(decision.items())},
            "redis_usec_per_decision": round(cpu / n, 2),
            "replicas_scored_mean": round(statistics.fmean(fleet.scored), 2),
        }
    for fleet in fleets.values():
        await fleet.loads.close()
        await fleet.index.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefixgate bench router", description=__doc__)
    parser.add_argument("--blocks", type=int, default=1_000_000, help="block hashes published per fleet size")
    parser.add_argument("--replicas", default="8,256", help="fleet sizes, comma-separated, measured side by side")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="prompt length (64 blocks of 16)")
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--cluster", action="store_true", help="a private 3-master Redis Cluster instead of one redis-server")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    sizes = [int(x) for x in str(args.replicas).split(",") if x]
    rng = random.Random(0)
    system = [rng.randrange(50_000) for _ in range(SYSTEM_TOKENS)]
    prompts = [system + [rng.randrange(50_000) for _ in range(args.prompt_tokens - SYSTEM_TOKENS)] for _ in range(64)]
    if args.cluster:
        from gateway.local_redis_cluster import LocalRedisCluster

        server = LocalRedisCluster().start()
        nodes = [redis.Redis(port=n.port) for n in server.nodes]
    else:
        server = LocalRedis().start()
        nodes = [redis.Redis(port=server.port)]
    try:
        client = _client(server.url, args.cluster)
        fleets = {}
        for r in sizes:
            prefix = f"bench{r}"
            t0 = time.monotonic()
            n = populate(client, RedisKeys(prefix), [f"r{i}" for i in range(r)], args.blocks, prompts, r)
            print(f"R={r}: published {n} block entries in {time.monotonic() - t0:.1f} s", flush=True)
            fleets[r] = Fleet(server.url, prefix, [f"r{i}" for i in range(r)])
        results = asyncio.run(measure(server.url, fleets, prompts, args.iterations, nodes))
    finally:
        server.cleanup()
    for r in sizes:
        x = results[r]
        print(f"R={r:4d}: p50 {x['p50_ms']:.3f} ms  p99 {x['p99_ms']:.3f} ms  max {x['max_ms']:.3f} ms  "
              f"redis commands/decision {x['redis_commands_per_decision']}  redis usec/decision {x['redis_usec_per_decision']}  "
              f"replicas scored {x['replicas_scored_mean']}")
    if len(sizes) >= 2:
        lo, hi = results[sizes[0]], results[sizes[-1]]
        ratio = hi["p99_ms"] / lo["p99_ms"]
        print(f"p99 ratio R={sizes[-1]} / R={sizes[0]}: {ratio:.2f} (target <= 1.5)")
        results["p99_ratio"] = round(ratio, 3)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"blocks": args.blocks, "prompt_tokens": args.prompt_tokens, "cluster": args.cluster,
                       "results": {str(k): v for k, v in results.items()}}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
