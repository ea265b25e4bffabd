"""LoRA decode throughput: a batch of rows over several adapters against the same batch of
base-model rows, in one process, rounds interleaved.

    prefixgate bench lora [--rows 16] [--adapters 4] [--rank 8] [--new-tokens 64] [--rounds 3]

Adapters are random peft adapters of the bundled model on attention and MLP projections
(loadtest/bench/lora_adapters.py). Batches of `--rows` greedy requests with distinct prompts on
one LoRA engine, interleaved: base-model rows, and rows spread round-robin over `--adapters`
adapters; then base rows on an engine without LoRA (after the first is gone: one engine per
process, as on a replica). Decode
throughput is timed from the step after every row has its first token to the last token, so the
figure is the decode batch's alone. Prints each round and the median ratios.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from loadtest.bench.lora_adapters import ATTENTION_MLP, make_adapter
from replica.default_model import default_model_dir
from replica.engine import EngineConfig, LLMEngine, SamplingParams

say = functools.partial(print, flush=True)
PROMPT_TOKENS = 32


def decode_rate(engine: LLMEngine, rows: int, adapters: list[str | None], new_tokens: int, salt: int) -> float:
    """Decoded tokens per second of one batch, once every row has its first token."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i in range(rows):
        prompt = [(7 + salt * 131 + i * 17 + j) % 40000 + 100 for j in range(PROMPT_TOKENS)]
        engine.add_request(prompt, params, adapter=adapters[i % len(adapters)])
    started: set[str] = set()
    while len(started) < rows:  # prefills (and their first tokens)
        started |= {o.request_id for o in engine.step()}
    tokens, t0 = 0, time.perf_counter()
    while engine.has_unfinished:
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prefixgate bench lora", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16, help="requests decoding together")
    p.add_argument("--adapters", type=int, default=4, help="adapters the LoRA batch's rows are spread over")
    p.add_argument("--rank", type=int, default=8, help="each adapter's LoRA rank")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens each request decodes")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the three batches")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = str(default_model_dir())
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"lora-{i}" for i in range(args.adapters)]
        say(f"building {args.adapters} rank-{args.rank} adapters of {Path(model).name} with peft ...")
        dirs = {n: make_adapter(model, f"{tmp}/{n}", ATTENTION_MLP, args.rank, seed=i) for i, n in enumerate(names)}
        common = dict(model=model, num_blocks=args.rows * 8 + 64, max_num_seqs=args.rows)
        # one engine at a time: two engines in one process slowed the first one's steps several
        # fold here (measured: 15 against 94 tok/s alone), which a replica never sees
        lora = LLMEngine(config=EngineConfig(**common, lora_adapters=dirs, max_loras=args.adapters,
                                             max_lora_rank=args.rank, max_cpu_loras=args.adapters))
        decode_rate(lora, args.rows, names, 4, salt=999)  # warm-up: first calls and slot loads
        rates: dict[str, list[float]] = {"base_on_lora_engine": [], "lora": [], "base": []}
        for r in range(args.rounds):  # base rows and adapter rows on the same engine, interleaved
            for ads, key in (([None], "base_on_lora_engine"), (names, "lora")):
                lora.blocks.clear_cache()
                rates[key].append(decode_rate(lora, args.rows, ads, args.new_tokens, salt=r))
            say(f"round {r + 1}: base rows {rates['base_on_lora_engine'][-1]:.0f} tok/s, "
                f"rows over {args.adapters} adapters {rates['lora'][-1]:.0f} tok/s")
        del lora
        plain = LLMEngine(config=EngineConfig(**common))  # the wrappers' cost: base rows without LoRA
        decode_rate(plain, args.rows, [None], 4, salt=999)
        for r in range(args.rounds):
            plain.blocks.clear_cache()
            rates["base"].append(decode_rate(plain, args.rows, [None], args.new_tokens, salt=r))
        say(f"engine without LoRA, base rows: {', '.join(f'{x:.0f}' for x in rates['base'])} tok/s")
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratio = med["lora"] / med["base_on_lora_engine"]
    say(f"\n{args.rows} rows over {args.adapters} adapters (rank {args.rank}, attention+MLP): "
        f"{med['lora']:.0f} tok/s against {med['base_on_lora_engine']:.0f} for {args.rows} base rows on the same "
        f"engine: x{ratio:.2f}; against an engine without LoRA ({med['base']:.0f} tok/s, not interleaved): "
        f"x{med['lora'] / med['base']:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rates": rates,
                                         "median": med, "ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
