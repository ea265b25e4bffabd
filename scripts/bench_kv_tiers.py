"""TTFT of a long prefix served from the host tier, the disk tier or the pool, against recompute.

    flock /tmp/prefixgate-heavy.lock .venv/bin/python scripts/bench_kv_tiers.py --rounds 5

Library API only (LLMEngine, the bundled model, fp32): two engines with a small pool, one with
a host tier and one whose host tier is tiny so evicted blocks end on its disk tier. Per round,
on a fresh random prefix P of --prefix tokens:
  recompute  a fresh prompt of the same length, computed whole
  device     P + a new question while P is still in the pool
  host       P + a new question after filler prompts pushed P's blocks out of the pool
  disk       the same on the engine whose host tier overflows to disk
TTFT is add_request to the first token, one request at a time. The paths run in a rotating
order per round; prints medians, ratios to recompute, and the copy rates the engines measured
(what their heartbeats report). docs/kv-tiers.md has results.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replica.default_model import resolve_model  # noqa: E402
from replica.engine import LLMEngine, SamplingParams  # noqa: E402
from replica.model.model_runner import ModelRunner  # noqa: E402
from router.protocol.media import DISK, HOST  # noqa: E402

ONE = SamplingParams(max_tokens=1, ignore_eos=True)


def ttft(engine: LLMEngine, prompt: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    rid = engine.add_request(prompt, ONE)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids:
                elapsed = time.perf_counter() - start
                while engine.has_unfinished:
                    engine.step()
                return elapsed, out.num_cached_tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix", type=int, default=1000, help="prefix tokens")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    bs = 16
    pool = -(-a.prefix // bs) + 8  # P fits, and one filler of P's size pushes it out
    block_bytes = ModelRunner.read_shape(str(resolve_model(None))).bytes_per_block(bs, torch.float32)
    host = LLMEngine(block_size=bs, num_blocks=pool, kv_host_bytes=4 * pool * block_bytes, max_model_len=4096)
    disk = LLMEngine(block_size=bs, num_blocks=pool, kv_host_bytes=4 * block_bytes, kv_disk_bytes=4 * pool * block_bytes,
                     max_model_len=4096)
    vocab = host.vocab_size
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    for engine in (host, disk):  # warm-up, other prompts than the measured ones
        ttft(engine, tokens(a.prefix))
    times: dict[str, list[float]] = {k: [] for k in ("recompute", "device", "host", "disk")}
    cached: dict[str, list[int]] = {k: [] for k in times}
    def measure(path: str, prefix: list[int]) -> tuple[float, int]:
        if path == "recompute":
            return ttft(host, tokens(a.prefix + 16))
        engine = disk if path == "disk" else host
        ttft(engine, prefix + tokens(16))  # P computed: its blocks are in the pool
        if path != "device":
            ttft(engine, tokens(a.prefix + 16))  # filler: P's blocks leave the pool for the tiers
        return ttft(engine, prefix + tokens(16))

    order = list(times)
    for r in range(a.rounds):
        prefix = tokens(a.prefix)
        for name in order[r % 4 :] + order[: r % 4]:
            t, c = measure(name, prefix)
            times[name].append(t)
            cached[name].append(c)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"prefix {a.prefix} tokens, {a.rounds} rounds, {a.threads} threads, fp32")
    print(f"{'path':<10} {'TTFT ms':>9} {'x recompute':>12} {'cached tokens':>14}")
    for k, v in med.items():
        print(f"{k:<10} {v * 1000:9.1f} {med['recompute'] / v:12.2f}x {statistics.median(cached[k]):14.0f}")
    rates = {HOST: host.stats().tiers[HOST].promotion_bytes_per_s, DISK: disk.stats().tiers[DISK].promotion_bytes_per_s}
    print(f"measured copy rates back into the pool: host {rates[HOST] / 1e9:.2f} GB/s, disk {rates[DISK] / 1e9:.2f} GB/s")
    if a.json:
        a.json.write_text(json.dumps({"median_s": med, "times_s": times, "cached": cached, "rates": rates}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
