"""Sampler step time: the batched sampler against the per-row loop it replaced, side by side.

    .venv/bin/python scripts/bench_sampler.py [--rows 16 64] [--vocab 49152] [--iters 20] [--device cpu]

Both sample the same logits with the same requests (three mixes of temperature, top-k and top-p,
half of the rows seeded); runs are interleaved and the median of each is reported with their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

import torch

from replica.model.sampler import Sampler
from router.protocol.sampling import SamplingParams


@dataclass
class Row:
    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=lambda: [0])
    output_token_ids: list[int] = field(default_factory=list)


class PerRowSampler:
    """The previous sampler: one row at a time, each copied to the host in float64."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self._shared = torch.Generator()
        self._shared.seed()

    def sample(self, logits: torch.Tensor, rows: list[Row]) -> list[int]:
        greedy = logits.argmax(dim=-1).tolist()
        out = []
        for i, row in enumerate(rows):
            p = row.params
            if p.greedy:
                out.append(greedy[i])
                continue
            scores = logits[i].cpu().double() / p.temperature
            if 0 < p.top_k < scores.numel():
                kth = torch.topk(scores, p.top_k).values[-1]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            if p.top_p < 1.0:
                sorted_probs, order = probs.sort(descending=True)
                drop = sorted_probs.cumsum(0) - sorted_probs > p.top_p
                sorted_probs[drop] = 0.0
                probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
            gen = self._shared
            if p.seed is not None:
                gen = self._generators.setdefault(row.request_id, torch.Generator().manual_seed(p.seed))
            out.append(int(torch.multinomial(probs, 1, generator=gen)))
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    scenarios = {
        "top_k=50 top_p=0.9": dict(temperature=0.8, top_k=50, top_p=0.9),
        "top_p=0.9": dict(temperature=0.8, top_p=0.9),
        "temperature only": dict(temperature=0.8),
    }
    for (label, kw), n in ((s, n) for s in scenarios.items() for n in args.rows):
        rows = [Row(f"r{i}", SamplingParams(seed=i if i % 2 else None, **kw)) for i in range(n)]
        logits = torch.randn(n, args.vocab, device=device) * 3
        new, old = Sampler(), PerRowSampler()
        times: dict[str, list[float]] = {"batched": [], "per-row": []}
        for _ in range(args.iters):
            for name, sampler in (("batched", new), ("per-row", old)):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                sampler.sample(logits, rows)
                times[name].append(time.perf_counter() - start)
        b, o = statistics.median(times["batched"]), statistics.median(times["per-row"])
        print(f"{label:20s} {n:3d} rows x {args.vocab} vocab on {device}: batched {b * 1e3:7.2f} ms, "
              f"per-row {o * 1e3:7.2f} ms, per-row / batched = {o / b:.2f}x")


if __name__ == "__main__":
    main()
