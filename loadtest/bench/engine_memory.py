"""Decode-step peak memory: it must grow with the tokens in the batch, not with batch x the
longest context (the padded layout this engine used to gather).

    prefixgate bench engine --decode-memory [--short-len 32] [--long-len 1024] [--num-short 32]

One decode step of the real model runs over hand-built block tables (K/V contents do not change
memory or time): 32 short + 1 long sequences, against 33 long ones (what padding every row to
the longest costs) and each part alone. Peak memory is the allocator's high-water mark during
the step above what was allocated before it: torch.cuda's peak counter on CUDA, the profiler's
allocation events on CPU.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import torch

from replica.core.scheduler import ScheduledChunk
from replica.core.sequence import Sequence
from replica.engine import LLMEngine
from router.protocol.sampling import SamplingParams


@dataclass
class StepMemory:
    label: str
    sequences: int
    context_tokens: int  # tokens attended in the step (sum of context lengths)
    padded_tokens: int  # sequences x longest context
    peak_bytes: int
    step_ms: float  # median of the timed repeats


def peak_bytes(fn, device: torch.device) -> int:
    """Allocator high-water mark while `fn` runs, above what was allocated before."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    return peak


def decode_chunks(engine: LLMEngine, lengths: list[int], rng: random.Random) -> list[ScheduledChunk]:
    """Sequences holding `lengths` tokens of blocks each, decoding their last position."""
    chunks = []
    for n in lengths:
        seq = Sequence([rng.randrange(3, engine.vocab_size) for _ in range(n)], SamplingParams(), hash_seed=0)
        engine.blocks.allocate(seq.table, n)
        chunks.append(ScheduledChunk(seq, n - 1, n))
    return chunks


def measure(engine: LLMEngine, label: str, lengths: list[int], repeats: int = 3) -> StepMemory:
    rng = random.Random(0)
    chunks = decode_chunks(engine, lengths, rng)
    try:
        engine.runner.run(list(chunks))  # warm-up: first-call allocations stay out
        peak = peak_bytes(lambda: engine.runner.run(list(chunks)), engine.runner.device)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.runner.run(list(chunks))
            if engine.runner.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    finally:
        for c in chunks:
            engine.blocks.free(c.seq.table)
    return StepMemory(label, len(lengths), sum(lengths), len(lengths) * max(lengths), peak,
                      statistics.median(times) * 1e3)


def run(model: str | None, short_len: int, long_len: int, num_short: int, device: str = "cpu",
        dtype: str | None = None) -> list[StepMemory]:
    n = num_short + 1
    blocks = n * -(-long_len // 16) + 16
    engine = LLMEngine(model=model, block_size=16, num_blocks=blocks, device=device, dtype=dtype)
    cases = [
        (f"{num_short} short ({short_len}) + 1 long ({long_len})", [short_len] * num_short + [long_len]),
        (f"{n} long ({long_len}): batch x longest", [long_len] * n),
        (f"{num_short} short ({short_len}) alone", [short_len] * num_short),
        (f"1 long ({long_len}) alone", [long_len]),
    ]
    return [measure(engine, label, lengths) for label, lengths in cases]


def report(results: list[StepMemory], say=print) -> None:
    say("Decode step peak memory (one forward pass, all layers):")
    say(f"  {'batch':<38} {'context tok':>11} {'padded tok':>10} {'peak MiB':>9} {'step ms':>8}")
    for r in results:
        say(f"  {r.label:<38} {r.context_tokens:>11} {r.padded_tokens:>10} {r.peak_bytes / 2**20:>9.1f} {r.step_ms:>8.1f}")
    mixed, padded = results[0], results[1]
    say(f"  mixed batch / batch x longest: peak x{mixed.peak_bytes / padded.peak_bytes:.3f}, "
        f"tokens x{mixed.context_tokens / padded.context_tokens:.3f}, step time x{mixed.step_ms / padded.step_ms:.2f}")
