"""The fixed request mix of `prefixgate bench goodput` and its Poisson arrivals (pure: no I/O).

The mix is a constant of the benchmark, not an option, so the benchmark cannot be tuned to
itself (issue 52, item 6):

  chat   60%  one of 4 shared system prompts (200, 330, 470, 600 tokens) + a user turn of
              16-64 tokens; 64 output tokens; objectives TTFT 3x, TPOT 2x the class's unloaded p50
  rag    30%  one of 8 shared documents (1,976-3,936 tokens, 280 apart) as the prefix, then a
              question of 24-64 tokens: 2,000-4,000-token prompts; 128 output tokens;
              objectives TTFT 5x, TPOT 3x
  batch  10%  a 1,000-token prompt of its own, `service_tier: flex`; 256 output tokens; no objectives

Prompts are token ids (exact lengths; the shared prefixes are the same ids every time, so they
are prefix-cache hits once cached). The shared prefixes' content comes from a fixed seed
(MIX_SEED), the same for every run; `--seed` draws only the arrivals and each request's class
and own tokens. `scale` multiplies every prompt length (never the outputs) for a model whose
context or speed cannot take them as given.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

MIX_SEED = 52  # the shared prompts' content: fixed, never the run's seed
TOKEN_IDS = (1000, 20000)  # drawn from this range of the vocabulary (as the other benches' prompts)


@dataclass(frozen=True)
class RequestClass:
    name: str
    share: float
    max_tokens: int
    tier: str | None = None  # service_tier sent (None: the default)
    ttft_x: float | None = None  # objective: this many times the class's unloaded TTFT p50 (None: no objective)
    tpot_x: float | None = None

    @property
    def has_objectives(self) -> bool:
        return self.ttft_x is not None and self.tpot_x is not None


CLASSES = (
    RequestClass("chat", 0.6, 64, ttft_x=3.0, tpot_x=2.0),
    RequestClass("rag", 0.3, 128, ttft_x=5.0, tpot_x=3.0),
    RequestClass("batch", 0.1, 256, tier="flex"),
)
BY_NAME = {c.name: c for c in CLASSES}
SYSTEM_PROMPT_TOKENS = (200, 330, 470, 600)
USER_TURN_TOKENS = (16, 64)
DOCUMENTS = 8
RAG_PROMPT_TOKENS = (2000, 4000)
QUESTION_TOKENS = (24, 64)
BATCH_PROMPT_TOKENS = 1000


def document_tokens() -> list[int]:
    """The 8 documents' lengths: spread evenly so that document + question spans 2,000-4,000."""
    lo = RAG_PROMPT_TOKENS[0] - QUESTION_TOKENS[0]
    hi = RAG_PROMPT_TOKENS[1] - QUESTION_TOKENS[1]
    return [lo + k * (hi - lo) // (DOCUMENTS - 1) for k in range(DOCUMENTS)]


@dataclass(frozen=True)
class Request:
    cls: str
    prompt: tuple[int, ...]
    max_tokens: int
    tier: str | None
    prefix: int  # which shared prefix it starts with (system prompt or document index; -1: none)


def _ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(*TOKEN_IDS) for _ in range(n))


class Mix:
    """The mix at a length scale: its shared prefixes, built once, and draws of requests."""

    def __init__(self, scale: float = 1.0) -> None:
        if not 0 < scale <= 1:
            raise ValueError(f"length scale must be in (0, 1], got {scale}")
        self.scale = scale
        content = random.Random(MIX_SEED)
        self.system_prompts = [_ids(content, self.n(t)) for t in SYSTEM_PROMPT_TOKENS]
        self.documents = [_ids(content, self.n(t)) for t in document_tokens()]

    def n(self, tokens: int) -> int:
        """A prompt length at this scale (at least one token)."""
        return max(1, round(tokens * self.scale))

    def longest(self) -> int:
        """The longest prompt + output the mix can send (what the model's context must hold)."""
        return max(self.n(SYSTEM_PROMPT_TOKENS[-1]) + self.n(USER_TURN_TOKENS[1]) + BY_NAME["chat"].max_tokens,
                   self.n(document_tokens()[-1]) + self.n(QUESTION_TOKENS[1]) + BY_NAME["rag"].max_tokens,
                   self.n(BATCH_PROMPT_TOKENS) + BY_NAME["batch"].max_tokens)

    def pick(self, rng: random.Random) -> RequestClass:
        u, acc = rng.random(), 0.0
        for c in CLASSES:
            acc += c.share
            if u < acc:
                return c
        return CLASSES[-1]

    def request(self, cls: str, rng: random.Random) -> Request:
        """One request of class `cls`, its own tokens drawn from `rng`."""
        c = BY_NAME[cls]
        if cls == "chat":
            k = rng.randrange(len(self.system_prompts))
            own = self.n(rng.randint(*USER_TURN_TOKENS))
            return Request(cls, self.system_prompts[k] + _ids(rng, own), c.max_tokens, c.tier, k)
        if cls == "rag":
            k = rng.randrange(len(self.documents))
            own = self.n(rng.randint(*QUESTION_TOKENS))
            return Request(cls, self.documents[k] + _ids(rng, own), c.max_tokens, c.tier, k)
        return Request(cls, _ids(rng, self.n(BATCH_PROMPT_TOKENS)), c.max_tokens, c.tier, -1)

    def draw(self, rng: random.Random) -> Request:
        return self.request(self.pick(rng).name, rng)

    def warmers(self) -> list[Request]:
        """Each shared prefix once (a chat turn per system prompt, a question per document)."""
        rng = random.Random(MIX_SEED + 1)
        chats = [Request("chat", p + _ids(rng, self.n(USER_TURN_TOKENS[0])), 2, None, k) for k, p in enumerate(self.system_prompts)]
        docs = [Request("rag", d + _ids(rng, self.n(QUESTION_TOKENS[0])), 2, None, k) for k, d in enumerate(self.documents)]
        return chats + docs


def arrivals(mix: Mix, rate: float, seconds: float, seed: int, step: int) -> list[tuple[float, Request]]:
    """Poisson arrivals at `rate` per second over `seconds`: (offset s, request). The same
    (seed, step) gives the same arrivals, whatever the mode."""
    rng = random.Random(seed * 1_000_003 + step)
    out, t = [], rng.expovariate(rate)
    while t < seconds:
        out.append((t, mix.draw(rng)))
        t += rng.expovariate(rate)
    return out
