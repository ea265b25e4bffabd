"""Request streams for the simulator: the Mooncake trace and two generated workloads.

A request is reduced to what routing and caching depend on: arrival time, the chained block
keys of its prompt (one per block, the last one possibly partial, as in the Mooncake trace),
token counts, an optional session id and, under a LoRA adapter, the adapter's identity
(router/sim/lora.py).
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path

SESSION_MODES = ("none", "prefix2")
WARMUP = "warmup"  # SimRequest.kind of requests that warm caches and are left out of the figures


@dataclass(slots=True)
class SimRequest:
    arrival: float  # seconds from the start of the trace
    hashes: list[int]  # block keys, chained: key i stands for the whole prefix up to block i
    input_tokens: int
    output_tokens: int
    session_id: str | None = None
    adapter: str | None = None  # the LoRA adapter's identity (router/sim/lora.py); None: the base model
    # under an adapter: the blocks' keys as the base model has them (what a router that ignores
    # adapters hashes); `hashes` are then the keys rooted at the adapter's identity
    base_hashes: list[int] | None = None
    kind: str | None = None  # its class in a mix (router/sim/pd_workload.py); WARMUP: not measured


def load_mooncake(path: str | Path, *, sessions: str = "none", limit: int | None = None) -> list[SimRequest]:
    """Read the Mooncake trace (512-token blocks, hash ids used as block keys directly).

    The trace has no conversation ids, and an OpenAI-style client need not send one, so by
    default (sessions="none") requests carry none and the router must find conversations
    through the prefix index alone. sessions="prefix2" derives a pseudo-session from the first
    two block ids instead: every prompt starts with the same block 0 (a shared system prompt),
    so block 1 is the first that tells conversations apart; in this trace a request whose first
    two blocks were seen before is exactly one that reuses an earlier prompt beyond block 0.
    """
    if sessions not in SESSION_MODES:
        raise ValueError(f"sessions must be one of {SESSION_MODES}")
    out: list[SimRequest] = []
    with open(path) as f:
        for line in itertools.islice(f, limit):
            r = json.loads(line)
            ids = r["hash_ids"]
            sid = f"{ids[0]}/{ids[1]}" if sessions == "prefix2" and len(ids) >= 2 else None
            out.append(SimRequest(r["timestamp"] / 1000.0, ids, r["input_length"], r["output_length"], sid))
    out.sort(key=lambda q: q.arrival)
    return out


def distinct_blocks(requests: list[SimRequest]) -> int:
    return len({h for r in requests for h in r.hashes})


def _zipf_cum(n: int, s: float) -> list[float]:
    return list(itertools.accumulate(1.0 / (i + 1) ** s for i in range(n)))


class _Ids:
    """Fresh block keys, unique within one generated workload."""

    def __init__(self) -> None:
        self._next = itertools.count(1)

    def take(self, n: int = 1) -> list[int]:
        return [next(self._next) for _ in range(n)]


@dataclass
class ChatWorkload:
    """Multi-turn chats over a few shared system prompts (Zipf popularity), with session ids.

    Turn k+1's prompt is turn k's prompt + its answer + a new user message, so every full block
    of turn k is a prefix block of turn k+1; the partial last block is new each turn."""

    sessions: int = 3500
    duration_s: float = 600.0  # turns after it are dropped; sized for ~60% load on 8 replicas
    system_prompts: int = 16
    system_blocks: int = 4
    zipf_s: float = 1.1
    turns_mean: float = 5.0
    user_tokens_mean: float = 400.0
    output_tokens_mean: float = 300.0
    think_s_mean: float = 60.0
    block_size: int = 512

    def generate(self, seed: int = 0) -> list[SimRequest]:
        rng = random.Random(seed)
        ids = _Ids()
        bs = self.block_size
        systems = [ids.take(self.system_blocks) for _ in range(self.system_prompts)]
        cum = _zipf_cum(self.system_prompts, self.zipf_s)
        out: list[SimRequest] = []
        for s in range(self.sessions):
            stream = list(rng.choices(systems, cum_weights=cum)[0])  # stable keys of full blocks
            history = self.system_blocks * bs
            t = rng.uniform(0.0, self.duration_s)
            turns = 1 + int(rng.expovariate(1.0 / max(self.turns_mean - 1.0, 1e-9)))
            for _ in range(turns):
                if t > self.duration_s:
                    break
                prompt = history + max(1, int(rng.expovariate(1.0 / self.user_tokens_mean)))
                full = prompt // bs
                if full > len(stream):
                    stream += ids.take(full - len(stream))
                hashes = stream[:full] + (ids.take(1) if prompt % bs else [])
                answer = max(1, int(rng.expovariate(1.0 / self.output_tokens_mean)))
                out.append(SimRequest(t, hashes, prompt, answer, f"chat-{s}"))
                history = prompt + answer
                t += rng.expovariate(1.0 / self.think_s_mean) + 0.03 * answer
        out.sort(key=lambda q: q.arrival)
        return out


@dataclass
class RagWorkload:
    """Retrieval-augmented prompts: instruction preamble + one retrieved document (Zipf
    popularity) + a fresh question. Hot documents are hot prefixes; no session ids."""

    requests: int = 12000
    duration_s: float = 1800.0  # sized for ~60% prefill load on 8 replicas, cache-blind
    preambles: int = 4
    preamble_blocks: int = 2
    documents: int = 3000
    doc_blocks: int = 12
    zipf_s: float = 1.0
    question_tokens_mean: float = 200.0
    output_tokens_mean: float = 200.0
    block_size: int = 512

    def generate(self, seed: int = 0) -> list[SimRequest]:
        rng = random.Random(seed)
        ids = _Ids()
        bs = self.block_size
        pre = [ids.take(self.preamble_blocks) for _ in range(self.preambles)]
        docs: dict[tuple[int, int], list[int]] = {}  # chained: a doc's keys depend on its preamble
        cum = _zipf_cum(self.documents, self.zipf_s)
        out: list[SimRequest] = []
        t = 0.0
        rate = self.requests / self.duration_s
        for _ in range(self.requests):
            t += rng.expovariate(rate)
            p = rng.randrange(self.preambles)
            d = rng.choices(range(self.documents), cum_weights=cum)[0]
            doc = docs.setdefault((p, d), ids.take(self.doc_blocks))
            q = max(1, int(rng.expovariate(1.0 / self.question_tokens_mean)))
            hashes = pre[p] + doc + ids.take(-(-q // bs))
            tokens = (self.preamble_blocks + self.doc_blocks) * bs + q
            answer = max(1, int(rng.expovariate(1.0 / self.output_tokens_mean)))
            out.append(SimRequest(t, hashes, tokens, answer))
        return out


WORKLOADS = {"chat": ChatWorkload, "rag": RagWorkload}
