"""TTFT of a request whose long prefix is pulled from another replica vs computed, side by side.

    flock /tmp/prefixgate-heavy.lock .venv/bin/python scripts/bench_kv_pull.py --rounds 5

Starts its own stack (local Ray, Serve, 2 replicas of the default model, its own Redis), then
per round, on fresh random prompts of --prefix tokens plus a 16-token question:
  holder  replica A computes prompt P cold (it then holds P's blocks)
  pulled  replica B gets P with a pull hint naming A: pulls the prefix, computes the rest
  cold    replica B gets a fresh prompt Q of the same length: computes it all
(pulled and cold alternate in order from round to round). Requests go to the chosen replica
through its actor (replica/kv_io/kv_pull.py's ReplicaCaller), max_tokens 1, greedy; TTFT is from
the call to the first token at the client. Prints medians, their ratio, bytes moved per pull,
pull latency and the rates B measured (what its heartbeat reports). docs/kv-pull.md has results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.config import AppConfig  # noqa: E402
from gateway.local_redis import free_port  # noqa: E402
from gateway.stack import APP_NAME, LocalStack  # noqa: E402
from replica.kv_io.kv_pull import ReplicaCaller  # noqa: E402
from router.protocol.messages import (  # noqa: E402
    DeltaChunk,
    EndChunk,
    ErrorChunk,
    GenerateRequest,
    KvSource,
    RouteDecision,
    decode_chunk,
)
from router.protocol.sampling import SamplingParams  # noqa: E402

BLOCK = 16


def ttft(caller: ReplicaCaller, rid: str, prompt: list[int], pull: KvSource | None = None) -> tuple[float, list[int], EndChunk]:
    """One greedy 1-token request on replica `rid` (with the router's pull hint, if any)."""
    import ray

    req = GenerateRequest(prompt_token_ids=prompt, params=SamplingParams(max_tokens=1, temperature=0.0))
    route = RouteDecision("affinity-pull", "pull", rid, 0, pull) if pull is not None else None
    actor = asyncio.run(caller._actor(rid))
    start = time.perf_counter()
    gen = actor.handle_request_streaming.options(num_returns="streaming").remote(
        caller.metadata("generate", True), req, route=route)
    first = None
    tokens: list[int] = []
    end = None
    for ref in gen:
        chunk = decode_chunk(ray.get(ref, timeout=300))
        if isinstance(chunk, ErrorChunk):
            raise RuntimeError(chunk)
        if isinstance(chunk, DeltaChunk):
            first = first if first is not None else time.perf_counter() - start
            tokens += chunk.token_ids
        elif isinstance(chunk, EndChunk):
            end = chunk
    return first, tokens, end


def replicas(caller: ReplicaCaller, stack: LocalStack, timeout_s: float = 120) -> list[str]:
    import redis

    from router.protocol.redis_schema import RedisKeys

    keys = RedisKeys(stack.config.key_prefix)
    client = redis.Redis.from_url(stack.config.redis_url, decode_responses=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        live = sorted(r for r in client.smembers(keys.replicas) if client.exists(keys.heartbeat(r)))
        if len(live) == 2:
            return live
        time.sleep(0.2)
    raise RuntimeError("two replicas never beat")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefix", type=int, default=1000, help="prefix tokens (rounded down to whole blocks)")
    ap.add_argument("--kv-cache-mb", type=int, default=256)
    ap.add_argument("--json", type=Path, help="write the measurements here")
    args = ap.parse_args()
    from ray.serve._private.common import DeploymentID

    prefix_blocks = args.prefix // BLOCK
    question = 16
    length = prefix_blocks * BLOCK + question
    config = AppConfig(redis_url="auto", key_prefix=f"bench-pull-{os.getpid()}", replicas=2,
                       kv_cache_mb=args.kv_cache_mb, max_model_len=2048)
    stack = LocalStack(config, port=free_port()).start()
    try:
        caller = ReplicaCaller(DeploymentID(name="PrefixCacheReplica", app_name=APP_NAME))
        a, b = replicas(caller, stack)
        rng = random.Random(0)

        def prompt() -> list[int]:
            return [rng.randrange(200, 40000) for _ in range(length)]

        warm = prompt()  # first requests pay one-time costs (allocator, kernels): not measured
        ttft(caller, a, warm)
        ttft(caller, b, warm, KvSource(a, prefix_blocks))
        rows = []
        for r in range(args.rounds):
            p, q = prompt(), prompt()
            t_holder, ref, _ = ttft(caller, a, p)
            runs = {}
            order = ["pulled", "cold"] if r % 2 == 0 else ["cold", "pulled"]
            for kind in order:
                if kind == "pulled":
                    runs[kind] = ttft(caller, b, p, KvSource(a, prefix_blocks))
                else:
                    runs[kind] = ttft(caller, b, q)
            t_pull, got, end = runs["pulled"]
            t_cold, _, end_cold = runs["cold"]
            if got != ref or end.cached_tokens != prefix_blocks * BLOCK or end_cold.cached_tokens != 0:
                raise RuntimeError(f"round {r}: pulled output {got} vs {ref}, cached {end.cached_tokens}")
            rows.append({"holder_cold_s": t_holder, "pulled_s": t_pull, "cold_s": t_cold})
            print(f"round {r}: cold {t_cold:.3f} s  pulled {t_pull:.3f} s  ratio {t_cold / t_pull:.1f}x", flush=True)
        stats = asyncio.run(caller.call(b, "info"))["stats"]["kv_pull"]
    finally:
        stack.stop()
    cold = statistics.median(r["cold_s"] for r in rows)
    pulled = statistics.median(r["pulled_s"] for r in rows)
    per_pull = stats["pulled_bytes"] / max(1, stats["ok"])
    result = {
        "prompt_tokens": length, "pulled_tokens": prefix_blocks * BLOCK, "rounds": rows,
        "ttft_cold_median_s": cold, "ttft_pulled_median_s": pulled, "ratio": cold / pulled,
        "bytes_per_pull": per_pull, "kv_pull_stats": stats, "cpus": os.cpu_count(),
    }
    print(f"{length}-token prompt, {prefix_blocks * BLOCK} tokens pulled; {args.rounds} rounds (machine shared)")
    print(f"TTFT median: recompute {cold:.3f} s, pulled {pulled:.3f} s: {cold / pulled:.1f}x")
    print(f"bytes per pull {per_pull / 1e6:.1f} MB; pull latency p50 {stats['latency_p50_s']:.4f} s "
          f"p99 {stats['latency_p99_s']:.4f} s; pull rate {stats['bytes_per_s'] / 1e9:.2f} GB/s; "
          f"prefill {stats['prefill_tokens_per_s']:.0f} tokens/s ({stats['transport']})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
