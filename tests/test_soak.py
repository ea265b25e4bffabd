"""Engine soak without Ray: thousands of requests through a pool far too small for them.

A tiny random model keeps it CPU-cheap; the small pool forces eviction and preemption on most
steps, and random aborts hit requests in every state (waiting, prefilling, decoding, preempted).
What must hold at the end: no request lost or hung, every block back to free or cached (none
referenced), the prefix-cache map consistent with the LRU, no per-request state left behind,
and flat memory (the K/V pool is preallocated, so growth means a leak).
"""

from __future__ import annotations

import asyncio
import gc
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest

from replica.async_engine import AsyncLLMEngine
from replica.engine import LLMEngine, RequestOutput
from router.protocol.messages import GenerateRequest
from router.protocol.sampling import SamplingParams

pytestmark = pytest.mark.slow

VOCAB = 384  # tests/conftest.py's tiny models
EOS = 2
BLOCK = 4
POOL = 96  # blocks: about 3 requests' worth at full length, for 24 in flight
NUM_REQUESTS = 1200
RSS_MARK = NUM_REQUESTS // 2  # RSS growth is measured from here to the end
CONCURRENCY = 24
ABORT_SHARE = 0.2
RSS_GROWTH_LIMIT_MB = 24.0


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def make_engine(model_dir: str) -> LLMEngine:
    return LLMEngine(model_dir, block_size=BLOCK, num_blocks=POOL, max_num_seqs=16, max_num_batched_tokens=96)


@dataclass
class Workload:
    """Prompts from a few shared prefixes plus random tails, and random sampling settings."""

    rng: random.Random
    prefixes: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prefixes = [[self.rng.randrange(3, VOCAB) for _ in range(n)] for n in (8, 24, 40, 64)]

    def prompt(self) -> list[int]:
        prefix = self.rng.choice(self.prefixes)[: self.rng.choice([8, 24, 40, 64])]
        return prefix + [self.rng.randrange(3, VOCAB) for _ in range(self.rng.randrange(0, 40))]

    def params(self) -> SamplingParams:
        r = self.rng
        greedy = r.random() < 0.4
        return SamplingParams(
            max_tokens=r.randrange(1, 48),
            temperature=0.0 if greedy else r.uniform(0.05, 1.5),
            top_p=r.choice([1.0, r.uniform(0.05, 1.0)]),
            top_k=r.choice([0, 0, 1, r.randrange(1, VOCAB + 50)]),
            seed=r.choice([None, r.randrange(0, 2**63)]),
            stop_token_ids=r.sample(range(3, VOCAB), r.choice([0, 0, 1, 3])),
            ignore_eos=r.random() < 0.5,
        )

    def salt(self) -> str | None:
        return self.rng.choice([None, None, "tenant-a", "tenant-b"])


def check_pool_at_rest(engine: LLMEngine) -> None:
    """Nothing in flight: every block free (no hash) or cached (hashed, in the LRU), none referenced."""
    b = engine.blocks
    assert not engine.requests, f"requests left in the engine: {list(engine.requests)[:5]}"
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.sampler._generators and not engine.sampler._requests, "per-request sampler state leaked"
    assert len(engine.runner.inputs.batch) == 0, "rows of the persistent batch leaked"
    assert all(c == 0 for c in b.ref_count), [i for i, c in enumerate(b.ref_count) if c]
    assert b.num_used == 0
    free, lru = list(b.pool.free_ids), list(b.pool.lru)
    assert len(set(free)) == len(free) and not set(free) & set(lru)
    assert sorted(free + lru) == list(range(b.num_blocks))
    assert all(b.block_hash[i] is None for i in free)
    assert {b.block_hash[i] for i in lru} == set(b.hash_to_block)
    assert all(b.hash_to_block[b.block_hash[i]] == i for i in lru)


def check_pool_in_flight(engine: LLMEngine) -> None:
    """Mid-run: ref counts are exactly the running sequences' holdings; the rest is free or cached."""
    b = engine.blocks
    held = Counter(block for seq in engine.scheduler.running for block in seq.table.block_ids)
    assert all(not seq.table.block_ids for seq in engine.scheduler.waiting), "a waiting sequence holds blocks"
    assert all(b.ref_count[i] == held.get(i, 0) for i in range(b.num_blocks)), "ref counts drifted"
    free, lru = set(b.pool.free_ids), set(b.pool.lru)
    assert not free & lru and len(free) == len(b.pool.free_ids)
    for i in range(b.num_blocks):
        in_use = b.ref_count[i] > 0
        assert in_use + (i in free) + (i in lru) == 1, f"block {i} is in {in_use + (i in free) + (i in lru)} states"
    for h, i in b.hash_to_block.items():
        assert b.block_hash[i] == h


def check_finished(out: RequestOutput, streamed: list[int], params: SamplingParams, max_model_len: int) -> None:
    assert out.finished and out.finish_reason in ("stop", "length"), out
    assert out.token_ids == streamed, "streamed deltas do not add up to the final tokens"
    assert 1 <= len(out.token_ids) <= params.max_tokens
    last = out.token_ids[-1]
    if out.finish_reason == "length":
        assert len(out.token_ids) == params.max_tokens or out.num_prompt_tokens + len(out.token_ids) >= max_model_len
    else:
        assert last in params.stop_token_ids or (not params.ignore_eos and last == EOS), out
    assert all(0 <= t < VOCAB for t in out.token_ids)


# ---- through AsyncLLMEngine, as a replica runs it ------------------------------------------------
def test_async_soak_with_cancellations(tiny_model_dirs) -> None:
    engine = make_engine(tiny_model_dirs["llama"])
    aengine = AsyncLLMEngine(engine)
    rng = random.Random(20240617)
    work = Workload(rng)
    outcomes: Counter = Counter()
    rss: dict[str, float] = {}
    done = 0

    def count(outcome: str) -> None:
        nonlocal done
        outcomes[outcome] += 1
        done += 1
        if done % 250 == 0:  # mid-run, with the step loop paused
            aengine.call(check_pool_in_flight)
        if done == RSS_MARK:
            gc.collect()
            rss["mark"] = rss_mb()

    async def one(i: int) -> None:
        params, prompt, salt = work.params(), work.prompt(), work.salt()
        walk_after = rng.randrange(0, 6) if rng.random() < ABORT_SHARE / 2 else None  # the consumer walks away
        streamed: list[int] = []
        final: RequestOutput | None = None
        async for out in aengine.generate(GenerateRequest(prompt_token_ids=prompt, params=params, request_id=f"soak-{i}",
                                                          cache_salt=salt)):
            streamed += out.new_token_ids
            final = out
            if walk_after is not None and len(streamed) >= walk_after and not out.finished:
                break
        if final is not None and final.finished:
            check_finished(final, streamed, params, engine.max_model_len)
            count(f"finished_{final.finish_reason}")
        else:
            count("walked_away")

    async def scenario() -> None:
        gate = asyncio.Semaphore(CONCURRENCY)

        async def bounded(i: int) -> None:
            async with gate:
                task = asyncio.create_task(one(i))
                if rng.random() < ABORT_SHARE / 2:  # the consumer task itself is cancelled mid-stream
                    asyncio.get_running_loop().call_later(rng.uniform(0.0, 0.05), task.cancel)
                try:
                    await task
                except asyncio.CancelledError:
                    if not task.cancelled():
                        raise  # we are being cancelled ourselves (the global timeout)
                    count("cancelled")

        await asyncio.gather(*(bounded(i) for i in range(NUM_REQUESTS)))

    t0 = time.monotonic()
    try:
        asyncio.run(asyncio.wait_for(scenario(), timeout=300))  # a hang fails, it does not stall CI
        elapsed = time.monotonic() - t0
        deadline = time.monotonic() + 10  # the loop thread may still be finishing its last step
        while engine.has_unfinished and time.monotonic() < deadline:
            time.sleep(0.05)
        gc.collect()
        rss["last"] = rss_mb()
        stats = aengine.stats()
        print(f"\nasync soak: {NUM_REQUESTS} requests in {elapsed:.1f}s, {dict(outcomes)}, "
              f"steps {stats.steps}, evictions {stats.evictions}, preemptions {stats.preemptions}, "
              f"cached tokens {stats.cached_tokens}/{stats.prompt_tokens}, RSS {rss}")
        accounted = sum(outcomes.values())
        assert accounted == NUM_REQUESTS, f"{NUM_REQUESTS - accounted} requests neither finished nor aborted"
        assert outcomes["cancelled"] > 0 and outcomes["walked_away"] > 0
        assert stats.evictions > 0 and stats.preemptions > 0, "the pool was not small enough to stress anything"
        assert not aengine._streams, f"streams left registered: {list(aengine._streams)[:5]}"
        with aengine._lock:
            check_pool_at_rest(engine)
        assert aengine._thread.is_alive()
        growth = rss["last"] - rss["mark"]
        assert growth < RSS_GROWTH_LIMIT_MB, f"RSS grew {growth:.1f} MB over the last {NUM_REQUESTS - RSS_MARK} requests"
    finally:
        aengine.shutdown()


# ---- the synchronous step loop, with abort() -----------------------------------------------------
def test_step_loop_soak_with_aborts(tiny_model_dirs) -> None:
    engine = make_engine(tiny_model_dirs["llama"])
    rng = random.Random(7)
    work = Workload(rng)
    total = 800
    submitted = 0
    params: dict[str, SamplingParams] = {}
    streamed: dict[str, list[int]] = {}
    outcomes: Counter = Counter()
    steps = 0
    t0 = time.monotonic()
    while submitted < total or engine.has_unfinished:
        assert steps < 30_000, (  # ~2k steps when healthy: more is a livelock (pytest-timeout guards a hang)
            f"the step loop does not drain: {steps} steps, {submitted} submitted, {dict(outcomes)}, {engine.stats()}")
        for _ in range(rng.randrange(0, 4)):  # arrivals
            if submitted < total and len(engine.requests) < 40:
                rid = f"sync-{submitted}"
                params[rid] = work.params()
                engine.add_request(work.prompt(), params[rid], request_id=rid, cache_salt=work.salt())
                streamed[rid] = []
                submitted += 1
        if engine.requests and rng.random() < 0.12:  # aborts land on waiting, running and preempted requests
            rid = rng.choice(list(engine.requests))
            assert engine.abort(rid)
            assert not engine.abort(rid), "a second abort of the same request succeeded"
            outcomes["aborted"] += 1
            streamed.pop(rid)
        for out in engine.step():
            if out.request_id not in streamed:
                raise AssertionError(f"output for unknown or aborted request {out.request_id}")
            streamed[out.request_id] += out.new_token_ids
            if out.finished:
                check_finished(out, streamed.pop(out.request_id), params[out.request_id], engine.max_model_len)
                outcomes[f"finished_{out.finish_reason}"] += 1
        steps += 1
        if steps % 97 == 0:
            check_pool_in_flight(engine)
    stats = engine.stats()
    print(f"\nstep-loop soak: {total} requests in {time.monotonic() - t0:.1f}s, {steps} steps, {dict(outcomes)}, "
          f"evictions {stats.evictions}, preemptions {stats.preemptions}")
    assert sum(outcomes.values()) == total and not streamed, f"lost: {list(streamed)[:5]}"
    assert outcomes["aborted"] > 0 and stats.evictions > 0 and stats.preemptions > 0
    check_pool_at_rest(engine)
