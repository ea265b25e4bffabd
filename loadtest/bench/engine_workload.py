"""The engine benchmark's workload and our engine's runs over it, shared by the benchmark
(loadtest/bench/engine_bench.py) and its comparison against vLLM (loadtest/bench/vllm_bench.py):
the same prompts, the same runs and the same checks of what came out.
"""

from __future__ import annotations

import random
import statistics
import time
import zlib
from dataclasses import dataclass, field

from replica.engine import LLMEngine, RequestOutput, SamplingParams

SYSTEM_TEXT = (
    "You are the support assistant of Northwind Trading, a wholesale supplier of coffee, tea "
    "and kitchen equipment to cafes and restaurants. Answer politely and briefly, in plain "
    "language. Orders placed before two in the afternoon ship the same working day from the "
    "warehouse in Leeds; later orders ship the next working day. Standard delivery takes two to "
    "four days and is free above one hundred and fifty pounds. Express delivery costs twelve "
    "pounds and arrives the next day. Customers may return unopened goods within thirty days "
    "for a full refund; opened food products cannot be returned unless they are faulty. "
    "Equipment carries a two-year warranty that covers parts and labour but not damage caused "
    "by limescale or misuse. Trade accounts receive invoices payable within thirty days; new "
    "customers pay by card for their first three orders. Never promise delivery dates on bank "
    "holidays. If a question concerns allergens, refer the customer to the product sheet and "
    "suggest they contact the quality team. If you do not know an answer, say so and offer to "
    "pass the question to a colleague, giving the reference number of the conversation. "
)

QUESTIONS = [
    "Can I still get my order today if I place it at half past one?",
    "How much does express delivery cost to Manchester for a single grinder?",
    "My espresso machine stopped heating after eight months. Is that covered by the warranty?",
    "Do you deliver on Easter Monday?",
    "I opened a bag of decaf beans and it tastes stale, can I send it back for a refund?",
    "What are the payment terms for a new restaurant that wants a trade account with you?",
    "Is there free delivery if my basket comes to one hundred and twenty pounds?",
    "Does the chai blend contain any nuts or traces of sesame?",
    "The steam wand on my machine is blocked with scale, will you repair it for free?",
    "Who should I talk to about a wrong invoice amount on last month's statement?",
    "How long does standard delivery take to the Scottish Highlands?",
    "Can I return an unopened box of paper cups after six weeks?",
    "Do you sell descaling tablets for the bean-to-cup range?",
    "What happens if I order at four on a Friday afternoon?",
    "Can I pay my first order by bank transfer instead of card?",
    "Which teas do you stock that are caffeine free?",
]

# Scenario 1: ten questions of 10-28 tokens summing to 190, so the prompts total 1190 tokens.
SEED_SYSTEM_TOKENS = 100
SEED_QUESTION_LENGTHS = [12, 25, 16, 10, 28, 19, 22, 14, 24, 20]
QUESTION_TOKENS = 8  # scenario 2: 200 + 8 = 208-token prompts, like the baselines in docs/environment.md


# ---- prompts ----------------------------------------------------------------------------------
def exact_tokens(engine: LLMEngine, text: str, n: int) -> list[int]:
    """`n` token ids from real text (repeated if short), deterministic for a given tokenizer.

    A model without a tokenizer (the tiny test models) gets seeded pseudo-random ids instead.
    """
    if engine.tokenizer is None:
        rng = random.Random(zlib.crc32(text.encode()))
        return [rng.randrange(3, min(engine.vocab_size, 32_000)) for _ in range(n)]
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    return [ids[i % len(ids)] for i in range(n)]


def seed_prompts(engine: LLMEngine) -> list[list[int]]:
    system = exact_tokens(engine, SYSTEM_TEXT, SEED_SYSTEM_TOKENS)
    return [
        system + exact_tokens(engine, " " + QUESTIONS[i], n)
        for i, n in enumerate(SEED_QUESTION_LENGTHS)
    ]


def batch_prompts(engine: LLMEngine, requests: int, system_tokens: int) -> list[list[int]]:
    """Shared system prompt + a distinct short question per request."""
    system = exact_tokens(engine, SYSTEM_TEXT, system_tokens)
    prompts = []
    for i in range(requests):
        q = QUESTIONS[i % len(QUESTIONS)]
        if i >= len(QUESTIONS):
            q = f"(ticket {i}) {q}"  # distinct beyond the list
        prompts.append(system + exact_tokens(engine, " " + q, QUESTION_TOKENS))
    return prompts


# ---- our engine -------------------------------------------------------------------------------
def run_one(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[float, RequestOutput]:
    """Run a request alone; returns (seconds to its first token, final output)."""
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, params)
    ttft: float | None = None
    while True:
        for out in engine.step():
            if out.request_id != rid:
                continue
            if ttft is None and out.new_token_ids:
                ttft = time.perf_counter() - t0
            if out.finished:
                assert ttft is not None
                return ttft, out


def run_batch(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[RequestOutput]]:
    """Submit everything at once and step to completion (continuous batching)."""
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    return time.perf_counter() - t0, outs


@dataclass
class SeedResult:
    prompt_tokens: int
    computed_without_cache: int
    computed_with_cache: int
    hits: int
    requests: int
    cached_per_request: list[int]
    ttft_cold_first_ms: float  # request 1 of the cached pass (empty cache)
    ttft_no_cache_median_ms: float  # all requests of the no-cache pass
    ttft_warm_median_ms: float  # requests 2..10 of the cached pass
    outputs_equal: bool  # cache on/off gave the same greedy tokens

    @property
    def saved_fraction(self) -> float:
        return 1 - self.computed_with_cache / self.computed_without_cache


def scenario_seed(engine: LLMEngine, new_tokens: int) -> SeedResult:
    """Scenario 1: one request at a time, first without the cache, then with it."""
    prompts = seed_prompts(engine)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    cold: list[tuple[float, RequestOutput]] = []
    for p in prompts:
        engine.blocks.clear_cache()
        cold.append(run_one(engine, p, params))
    engine.blocks.clear_cache()
    warm = [run_one(engine, p, params) for p in prompts]
    computed = [o.num_prompt_tokens - o.num_cached_tokens for _, o in warm]
    return SeedResult(
        prompt_tokens=sum(len(p) for p in prompts),
        computed_without_cache=sum(o.num_prompt_tokens - o.num_cached_tokens for _, o in cold),
        computed_with_cache=sum(computed),
        hits=sum(1 for _, o in warm if o.num_cached_tokens > 0),
        requests=len(prompts),
        cached_per_request=[o.num_cached_tokens for _, o in warm],
        ttft_cold_first_ms=warm[0][0] * 1e3,
        ttft_no_cache_median_ms=statistics.median(t for t, _ in cold) * 1e3,
        ttft_warm_median_ms=statistics.median(t for t, _ in warm[1:]) * 1e3,
        outputs_equal=[o.token_ids for _, o in cold] == [o.token_ids for _, o in warm],
    )


@dataclass
class ThroughputResult:
    requests: int
    prompt_tokens: int
    new_tokens: int
    ours_s: float
    ours_tok_s: float
    ours_cached_tokens: int
    ours_steps: int
    generate_batch_s: float | None = None  # in-flight window
    generate_batch_call_s: float | None = None  # the whole call, manager setup and shutdown included
    generate_batch_tok_s: float | None = None
    sequential_s: float | None = None
    sequential_tok_s: float | None = None
    checked: int = 0
    matched: int = 0
    generate_batch_matched: int | None = None
    mismatched_ids: list[int] = field(default_factory=list)
    ours_tok_s_rounds: list[float] = field(default_factory=list)  # with --rounds N > 1
    generate_batch_tok_s_rounds: list[float] = field(default_factory=list)
    ratio_rounds: list[float] = field(default_factory=list)
    weights_step_s: float | None = None  # every linear layer once at `requests` rows (the weight reads)

    @property
    def weights_floor_s(self) -> float | None:
        """A lower bound on our run's time: each step reads every weight at least once."""
        return self.weights_step_s * self.ours_steps if self.weights_step_s is not None else None

    @property
    def ratio_generate_batch(self) -> float | None:
        if self.ratio_rounds:
            return statistics.median(self.ratio_rounds)
        return self.ours_tok_s / self.generate_batch_tok_s if self.generate_batch_tok_s else None

    @property
    def ratio_sequential(self) -> float | None:
        return self.ours_tok_s / self.sequential_tok_s if self.sequential_tok_s else None


def require_length(outs: list[list[int]], n: int, who: str) -> None:
    """A throughput figure only counts if every request produced exactly n tokens."""
    lengths = {len(o) for o in outs}
    if lengths != {n}:
        raise RuntimeError(f"{who} produced {sorted(lengths)} tokens per request, expected {n}")


def run_ours(engine: LLMEngine, prompts: list[list[int]], n: int) -> tuple[ThroughputResult, list[list[int]]]:
    """All requests at once from an empty cache: what the batch shares, it computes once."""
    engine.blocks.clear_cache()
    before = engine.stats()
    elapsed, outs = run_batch(engine, prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    after = engine.stats()
    tokens = [o.token_ids for o in outs]
    require_length(tokens, n, "our engine")
    res = ThroughputResult(
        requests=len(prompts), prompt_tokens=sum(map(len, prompts)), new_tokens=n,
        ours_s=elapsed, ours_tok_s=len(prompts) * n / elapsed,
        ours_cached_tokens=after.cached_tokens - before.cached_tokens, ours_steps=after.steps - before.steps,
    )
    return res, tokens


def fmt_values(values: list[float], digits: int = 1) -> str:
    return "/".join(f"{v:.{digits}f}" for v in values)
