"""Decode cascades on against off, interleaved in one process (docs/benchmarks.md).

Runs the engine benchmark's shared-prompt batch (loadtest/bench/engine_bench.py) with the per-prefix decode
cascades at their default threshold and with them out of reach, alternating rounds so machine
load hits both alike, and prints each round's output tok/s and the median ratio on/off:

    python scripts/bench_cascades.py --requests 16 64 --new-tokens 64 32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import replica.model.step_inputs as model_runner
from loadtest.bench.engine_bench import warm_up
from loadtest.bench.engine_workload import batch_prompts
from replica.engine import LLMEngine
from router.protocol.sampling import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, nargs="+", default=[16, 64])
    p.add_argument("--new-tokens", type=int, nargs="+", default=[64, 32], help="one per --requests entry")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine(model=None)
    warm_up(engine)
    default = model_runner.MIN_CASCADE_SAVED_BLOCKS
    for n, new in zip(args.requests, args.new_tokens, strict=True):
        prompts = batch_prompts(engine, n, 200)
        tok_s: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(args.rounds):
            for mode in tok_s:
                model_runner.MIN_CASCADE_SAVED_BLOCKS = default if mode == "on" else 10**9
                engine.blocks.clear_cache()
                t0 = time.perf_counter()
                engine.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True))
                tok_s[mode].append(n * new / (time.perf_counter() - t0))
        model_runner.MIN_CASCADE_SAVED_BLOCKS = default
        ratio = statistics.median(a / b for a, b in zip(tok_s["on"], tok_s["off"], strict=True))
        print(f"{n} requests x {new} tokens: on {[round(x, 1) for x in tok_s['on']]}, "
              f"off {[round(x, 1) for x in tok_s['off']]} tok/s; median ratio on/off {ratio:.3f}")


if __name__ == "__main__":
    main()
