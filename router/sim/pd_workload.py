"""`prefixgate bench goodput`'s fixed mix as a simulator workload, and its objectives.

The mix is the benchmark's own (loadtest/bench/goodput_mix.py, imported, not copied): 60% chat
over 4 shared system prompts (64 output tokens), 30% RAG over 8 shared documents (2,000-4,000
token prompts, 128 output tokens), 10% batch (1,000 fresh tokens, 256 output tokens, no
objectives), Poisson arrivals drawn by its `arrivals` (the same seed gives the same requests as
the benchmark). `classes=("chat",)` is the decode-heavy mix: chat alone.

Block keys follow the chained-hash rule without hashing the ids: the full blocks of a shared
prefix (system prompt or document) have one key each, the same in every request; the block
where the request's own tokens begin and every later one are new. Block size: the live
default of 16 tokens.

Objectives are the benchmark's: chat TTFT 3x and TPOT 2x the class's unloaded p50, RAG 5x and
3x, measured as the benchmark calibrates (`calibrate`): each class alone, one request at a
time, on one colocated replica whose caches hold the shared prefixes.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

from loadtest.bench.goodput_mix import BY_NAME, CLASSES, Mix, Request, arrivals
from router.costs.service import ServiceModel
from router.costs.transfer_model import TransferModel
from router.policy import make_policy
from router.sim.engine import SimConfig, run_policy
from router.sim.workload import WARMUP, SimRequest

BLOCK_SIZE = 16  # the live default (RouterOptions / the engine's block size)
CAPACITY_BLOCKS = 16384  # per replica: 262k tokens of K/V, ~84 GB at 320 KB/token (a 70B on one node)
MIXES = {"goodput": tuple(c.name for c in CLASSES), "chat": ("chat",)}


@dataclass
class GoodputMixWorkload:
    rate: float  # requests/s over the whole fleet
    duration_s: float = 120.0  # measured arrivals
    warmup_s: float = 10.0  # before them, at the same rate, not measured (the benchmark warms too)
    classes: tuple[str, ...] = MIXES["goodput"]
    block_size: int = BLOCK_SIZE
    scale: float = 1.0  # prompt lengths (goodput_mix.Mix)

    def __post_init__(self) -> None:
        self.mix = Mix(self.scale)
        self._ids = itertools.count(1)
        self._shared: dict[tuple[str, int], list[int]] = {}

    def _draws(self, seconds: float, seed: int, step: int) -> list[tuple[float, Request]]:
        if set(self.classes) == set(MIXES["goodput"]):
            return arrivals(self.mix, self.rate, seconds, seed, step)
        rng = random.Random(seed * 1_000_003 + step)  # the benchmark's seeding, one class at a time
        out, t = [], rng.expovariate(self.rate)
        while t < seconds:
            out.append((t, self.mix.request(rng.choice(self.classes), rng)))
            t += rng.expovariate(self.rate)
        return out

    def keys(self, req: Request) -> list[int]:
        """Chained block keys: the shared prefix's full blocks, then new keys to the end."""
        bs = self.block_size
        if req.prefix < 0:
            shared = 0
        else:
            prefixes = self.mix.system_prompts if req.cls == "chat" else self.mix.documents
            shared = len(prefixes[req.prefix]) // bs
        keys = self._shared.setdefault((req.cls, req.prefix), [next(self._ids) for _ in range(shared)])
        total = -(-len(req.prompt) // bs)
        return keys[:shared] + [next(self._ids) for _ in range(total - shared)]

    def request(self, t: float, req: Request, kind: str) -> SimRequest:
        return SimRequest(t, self.keys(req), len(req.prompt), req.max_tokens, kind=kind)

    def generate(self, seed: int = 0) -> list[SimRequest]:
        """Warm-up arrivals (kind WARMUP), then the measured ones (kind: their class)."""
        out = [self.request(t, r, WARMUP) for t, r in self._draws(self.warmup_s, seed, 1)]
        out += [self.request(self.warmup_s + t, r, r.cls) for t, r in self._draws(self.duration_s, seed, 0)]
        return out


def calibrate(service: ServiceModel, transfer: TransferModel, n: int = 20,
              capacity_blocks: int = CAPACITY_BLOCKS) -> dict[str, tuple[float, float]]:
    """Class -> (TTFT objective s, TPOT objective s), the benchmark's rule: x times the class's
    unloaded p50 (whole ms, rounded up), one request at a time on one colocated replica
    (step model) after the shared prefixes were sent once."""
    work = GoodputMixWorkload(rate=1.0)
    gap = 20.0  # seconds between requests: each runs alone
    reqs = [work.request(i * gap, w, WARMUP) for i, w in enumerate(work.mix.warmers())]
    t0 = len(reqs) * gap
    rng = random.Random(0)
    objectives = {}
    config = SimConfig(replicas=1, capacity_blocks=capacity_blocks, block_size=work.block_size, service=service,
                       transfer=transfer, step_model=True)
    for c in CLASSES:
        if not c.has_objectives:
            continue
        reqs_c = reqs + [work.request(t0 + i * gap, work.mix.request(c.name, rng), c.name) for i in range(n)]
        r = run_policy(reqs_c, make_policy("least-loaded", seed=0), config)
        assert r.pd is not None
        row = r.pd.classes[c.name]
        assert c.ttft_x is not None and c.tpot_x is not None
        objectives[c.name] = (math.ceil(c.ttft_x * row["ttft_p50_s"] * 1000) / 1000,
                              math.ceil(c.tpot_x * row["tpot_p50_s"] * 1000) / 1000)
    return objectives


def unloaded(objectives: dict[str, tuple[float, float]]) -> str:
    """The objectives as one line."""
    return ", ".join(f"{k} TTFT {v[0] * 1000:.0f} ms / TPOT {v[1] * 1000:.0f} ms ({BY_NAME[k].ttft_x:g}x/"
                     f"{BY_NAME[k].tpot_x:g}x unloaded p50)" for k, v in objectives.items())

