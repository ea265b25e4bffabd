"""Routing decision cost, the current code against an earlier commit's, side by side in one run.

`prefixgate bench router` times one version of the decision path. To show what a change to
it buys, this script loads `router/decider.py`, `router/load_table.py` and
`router/index/redis_index.py` as they were at `--before` (from git) next to the working tree's, publishes the same index as the benchmark
(loadtest.bench.router_bench.populate) into one private redis-server, and runs the two versions at the same
time in two processes (each its own event loop: one version's background load-table refresh
must not stall the other's decisions), each alternating its decisions between the fleet
sizes, so machine noise falls on all of them alike. Each decision is what
the Ray Serve router does per request: chain-hash the prompt, one Redis lookup, read this
router's queue lengths (Ray's ReplicaQueueLengthCache, keyed by ReplicaID), score with the
affinity policy. The old version reads every candidate's queue length (as the router did
before the change); the new one only the scored replicas'.

    python scripts/bench_router_compare.py --before ee52bad --replicas 8,256 --blocks 1000000
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ray.serve._private.common import DeploymentID, ReplicaID  # noqa: E402
from ray.serve._private.request_router.common import ReplicaQueueLengthCache  # noqa: E402

from gateway.local_redis import LocalRedis  # noqa: E402
from loadtest.bench.router_bench import BLOCK, SYSTEM_TOKENS, _client, populate  # noqa: E402
from router.decider import Decider, InflightPrefixes  # noqa: E402
from router.index.redis_index import RedisConfig, RedisIndex  # noqa: E402
from router.load_table import LoadTable  # noqa: E402
from router.policy import RouteRequest, make_policy  # noqa: E402
from router.protocol.hashing import block_hashes, chain_seed  # noqa: E402
from router.protocol.redis_schema import RedisKeys  # noqa: E402


def load_old(commit: str, tmp: Path):
    """(Decider, InflightPrefixes, LoadTable, RedisIndex) of `commit`, under private names."""
    classes = {}
    for name in ("redis_index", "load_table", "decider"):
        source = subprocess.run(["git", "show", f"{commit}:router/{name}.py"], check=True, capture_output=True,
                                text=True, cwd=Path(__file__).resolve().parent.parent).stdout
        path = tmp / f"old_{name}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(f"prefixgate_old_{name}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        classes[name] = module
    return (classes["decider"].Decider, classes["decider"].InflightPrefixes, classes["load_table"].LoadTable,
            classes["redis_index"].RedisIndex)


class Variant:
    """One version of the decision path for one fleet size."""

    def __init__(self, url: str, prefix: str, replicas: list[str], classes, lazy_queue: bool) -> None:
        decider_cls, inflight_cls, table_cls, index_cls = classes
        self.replicas = replicas
        self.index = index_cls(RedisConfig(url, prefix, timeout_s=2.0))  # a measurement, not a bound
        self.loads = table_cls(self.index, refresh_s=0.1, seed=0)
        self.decider = decider_cls(make_policy("affinity", seed=0), self.loads, inflight_cls(3.0), sampled=4)
        deployment = DeploymentID("LLMReplica", "prefixgate")
        self.replica_ids = {rid: ReplicaID(rid, deployment) for rid in replicas}
        self.queue_cache = ReplicaQueueLengthCache()
        for rid in self.replica_ids.values():
            self.queue_cache.update(rid, 1)
        self.lazy_queue = lazy_queue
        self.timings: list[float] = []
        self.cpu: list[float] = []  # this process's CPU per decision: scheduling noise excluded

    async def decide(self, tokens: list[int], session: str, record: bool) -> None:
        start, cpu = time.perf_counter(), time.process_time()
        hashes = block_hashes(tokens, BLOCK, chain_seed("bench"))
        look = await self.index.lookup(hashes, None, session)
        route = RouteRequest(hashes, len(tokens), BLOCK, session)
        if self.lazy_queue:
            def queue_len(rid: str) -> int:
                return self.queue_cache.get(self.replica_ids[rid]) or 0
        else:
            queue_len = {rid: self.queue_cache.get(r) or 0 for rid, r in self.replica_ids.items()}.get
        self.decider.score(route, list(self.replicas), look, queue_len)
        if record:
            self.timings.append(time.perf_counter() - start)
            self.cpu.append(time.process_time() - cpu)


async def measure(variants: dict[tuple[int, str], Variant], prompts: list[list[int]], iterations: int) -> None:
    for v in variants.values():
        for i in range(50):
            await v.decide(prompts[i % len(prompts)], f"s{i}", record=False)
        await v.loads.refresh()
    for i in range(iterations):
        for v in variants.values():
            await v.decide(prompts[i % len(prompts)], f"session-{i % 100}", record=True)
    for v in variants.values():
        await v.loads.close()
        await v.index.close()


def run_version(args, sizes: list[int], prompts: list[list[int]]) -> int:
    """Child process: one version, every fleet size alternated, its own event loop (a version's
    background load-table refresh must not stall the other version's decisions)."""
    with tempfile.TemporaryDirectory() as tmp:
        if args.version == "before":
            classes, lazy = load_old(args.before, Path(tmp)), False
        else:
            classes, lazy = (Decider, InflightPrefixes, LoadTable, RedisIndex), True
        variants = {(r, args.version): Variant(args.redis_url, f"cmp{r}", [f"r{i}" for i in range(r)], classes, lazy)
                    for r in sizes}
        asyncio.run(measure(variants, prompts, args.iterations))
    out = {}
    for (r, _), v in variants.items():
        ms = sorted(t * 1000 for t in v.timings)
        out[r] = {"p50": statistics.median(ms), "p90": ms[int(0.9 * (len(ms) - 1))],
                  "p99": ms[int(0.99 * (len(ms) - 1))], "cpu_us": statistics.fmean(v.cpu) * 1e6}
    print(json.dumps(out))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="HEAD", help="git commit whose decider, load table and index are 'before'")
    parser.add_argument("--replicas", default="8,256")
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--version", choices=("before", "after"), help=argparse.SUPPRESS)  # child process
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.replicas.split(",") if x]
    rng = random.Random(0)
    system = [rng.randrange(50_000) for _ in range(SYSTEM_TOKENS)]
    prompts = [system + [rng.randrange(50_000) for _ in range(args.prompt_tokens - SYSTEM_TOKENS)] for _ in range(64)]
    if args.version:
        return run_version(args, sizes, prompts)
    server = LocalRedis().start()
    try:
        client = _client(server.url, False)
        for r in sizes:
            t0 = time.monotonic()
            n = populate(client, RedisKeys(f"cmp{r}"), [f"r{i}" for i in range(r)], args.blocks, prompts, r)
            print(f"R={r}: published {n} block entries in {time.monotonic() - t0:.1f} s", flush=True)
        # both versions at once, each in its own process: the same machine noise falls on both
        children = {
            name: subprocess.Popen([sys.executable, __file__, "--version", name, "--redis-url", server.url,
                                    "--before", args.before, "--replicas", args.replicas,
                                    "--prompt-tokens", str(args.prompt_tokens), "--iterations", str(args.iterations)],
                                   stdout=subprocess.PIPE, text=True)
            for name in ("before", "after")
        }
        results = {}
        for name, child in children.items():
            out, _ = child.communicate(timeout=1200)
            if child.returncode != 0:
                raise RuntimeError(f"{name} run failed ({child.returncode})")
            results[name] = {int(r): v for r, v in json.loads(out.strip().splitlines()[-1]).items()}
    finally:
        server.cleanup()
    for r in sizes:
        for name in ("before", "after"):
            x = results[name][r]
            print(f"R={r:4d} {name:6s}: p50 {x['p50']:.3f} ms  p90 {x['p90']:.3f} ms  p99 {x['p99']:.3f} ms  "
                  f"process CPU {x['cpu_us']:.0f} us/decision")
    if len(sizes) >= 2:
        lo, hi = sizes[0], sizes[-1]
        for name in ("before", "after"):
            a, b = results[name][hi], results[name][lo]
            print(f"{name:6s}: R={hi} / R={lo}: p50 {a['p50'] / b['p50']:.2f}  p90 {a['p90'] / b['p90']:.2f}  "
                  f"p99 {a['p99'] / b['p99']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
