"""The replica's event loop never waits for the engine: stats, heartbeats, health and aborts
answer while one long forward pass runs. Ordering is checked with the engine's own step
counters (the answer came while step k had started and not finished), never wall-clock bounds.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest
import redis

from replica.async_engine import AsyncLLMEngine, EngineDeadError
from replica.engine import LLMEngine, SamplingParams
from router.protocol.messages import GenerateRequest, StartChunk, decode_chunk
from router.protocol.redis_schema import RedisKeys

GATE_GUARD_S = 150.0  # longest the held prefill step waits for the test (a hang guard, not a timing)


async def _until(cond, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def _make_replica(settings: dict):
    from replica.serve.deployment import PrefixCacheReplica

    replica = PrefixCacheReplica.__new__(PrefixCacheReplica)
    await replica.__init__(settings)  # Serve awaits the async constructor the same way
    return replica


def test_loop_answers_during_a_long_prefill(redis_server, default_model_dir):
    """One step prefills ~1,500 tokens in one forward pass (seconds on this CPU). While it
    runs: stats, info (what /health calls), check_health, a Redis heartbeat and the abort of
    the request itself all complete, and the step is still the same one afterwards.

    The step does not end before the test has seen all that: after its forward pass it holds
    on a gate the test opens last, so a fast machine (or a starved heartbeat task on a loaded
    one) cannot end the step first. Anything that waited for the step would wait for the
    gate: the gate gives up after a hang guard, the step then ends, and `still_in_step` fails
    naming what waited."""
    key_prefix = f"loop-{uuid.uuid4().hex[:6]}"
    settings = {
        "engine": {"engine": "model", "config": {"model": default_model_dir, "max_num_batched_tokens": 2048,
                                                 "max_model_len": 2048, "kv_cache_bytes": 96 * 2**20}},
        "redis_url": redis_server.url, "key_prefix": key_prefix,
    }

    async def scenario():
        replica = await _make_replica(settings)
        eng = replica.backend.engine
        # the prefill step: its real forward pass, then held until the test opens the gate
        gate, forward_s = threading.Event(), []
        real_step = eng.engine.step

        def held_step():
            t = time.perf_counter()
            outputs = real_step()
            forward_s.append(time.perf_counter() - t)
            if len(forward_s) == 1:  # the first step is the prefill; later ones run as they are
                gate.wait(GATE_GUARD_S)  # a hang guard: something waited for the step (asserted below)
            return outputs

        eng.engine.step = held_step  # the loop thread calls it as self.engine.step()
        try:
            await _until(lambda: replica.publisher.stats.resyncs > 0, "the first publish")
            tok = eng.engine.tokenizer
            prompt = tok.encode("The lighthouse keeper wrote in his log every night. " * 140)[:1500]
            request = GenerateRequest(prompt_token_ids=prompt, params=SamplingParams(max_tokens=64, ignore_eos=True))
            before = eng.steps_finished
            gen = replica.generate(request)
            assert isinstance(decode_chunk(await gen.__anext__()), StartChunk)
            pending = asyncio.ensure_future(gen.__anext__())  # submits the request, waits for output
            await _until(lambda: eng.step_started_at is not None and eng.steps_started == before + 1, "the prefill step")
            k = eng.steps_started  # the long step: started, not finished
            step_began = eng.step_started_at

            def still_in_step() -> bool:
                return eng.steps_started == k and eng.steps_finished == k - 1

            t0 = time.perf_counter()
            stats = eng.stats()
            t1 = time.perf_counter()
            assert still_in_step() and stats.waiting + stats.running == 1
            info = await replica.info()
            t2 = time.perf_counter()
            await replica.check_health()
            t3 = time.perf_counter()
            assert still_in_step(), "info/check_health waited for the step"
            assert info["stats"]["pending_prefill_tokens"] == len(prompt)
            # a heartbeat computed and written to Redis during the step. The publisher computes a
            # beat, writes it, then counts it (`beats`); this test shares its event loop, so of
            # the writes counted from now on only the first can have been computed before now:
            # two more written means one computed during the step is in Redis (or a later one,
            # also during the step, which the gate holds open)
            written = replica.publisher.beats
            await _until(lambda: replica.publisher.beats >= written + 2, "two heartbeats written during the step", 120)
            client = redis.Redis.from_url(redis_server.url, decode_responses=True)
            hb = client.hgetall(RedisKeys(key_prefix).heartbeat(replica.replica_id))
            assert int(hb["pending_prefill_tokens"]) == len(prompt)
            assert replica.heartbeats[-1] == (k, k - 1), list(replica.heartbeats)[-4:]
            assert still_in_step(), "the heartbeat waited for the step"
            # the client goes away: the abort is queued and the call returns during the step
            t4 = time.perf_counter()
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
            await gen.aclose()
            t5 = time.perf_counter()
            assert still_in_step(), "abort waited for the step"
            gate.set()  # the step may end now
            # after the step: the request is gone, its blocks freed, no decode step ever ran it
            await _until(lambda: eng.steps_finished >= k and eng.stats().running + eng.stats().waiting == 0,
                         "the abort to take effect")
            s = eng.stats()
            assert s.blocks_used == 0 and s.generated_tokens <= 1
            step_s = time.monotonic() - step_began
            print(f"\nduring a {step_s:.2f} s prefill step ({len(prompt)} tokens, forward pass {forward_s[0]:.2f} s): "
                  f"stats {1e3 * (t1 - t0):.3f} ms, info {1e3 * (t2 - t1):.2f} ms, "
                  f"check_health {1e3 * (t3 - t2):.2f} ms, abort {1e3 * (t5 - t4):.2f} ms")
            return k
        finally:
            gate.set()  # never leave the loop thread held (a failed assertion above)
            await replica.__del__()

    asyncio.run(asyncio.wait_for(scenario(), timeout=300))


@pytest.fixture
def aengine(tiny_model_dirs):
    engine = AsyncLLMEngine(LLMEngine(tiny_model_dirs["llama"], block_size=4, num_blocks=64))
    yield engine
    engine.shutdown()


def test_inbox_orders_answers_after_their_effects(aengine):
    """An answer never precedes the state it produced: the stats snapshot already shows a
    request added (or aborted) when the submit/abort that caused it has been answered."""

    async def scenario():
        params = SamplingParams(max_tokens=50, ignore_eos=True)
        gen = aengine.generate(GenerateRequest(prompt_token_ids=[5, 6, 7, 8, 9], params=params, request_id="a"))
        first = await gen.__anext__()
        assert first.new_token_ids
        await gen.aclose()  # abort queued
        # the next command is answered after the abort ran, and the snapshot reflects it
        blocks = await aengine.submit(lambda e: e.blocks.num_used)
        assert blocks == 0
        s = aengine.stats()
        assert s.running == 0 and s.waiting == 0 and s.blocks_used == 0
        out = [o async for o in aengine.generate(GenerateRequest(prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=3, ignore_eos=True)))]
        assert out[-1].finished and aengine.stats().generated_tokens >= 4

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


def test_hand_off_and_shutdown_fail_callers_cleanly(aengine):
    async def scenario():
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        gen = aengine.generate(GenerateRequest(prompt_token_ids=[3] * 10, params=params))
        await gen.__anext__()
        assert await aengine.hand_off("draining") == 1
        with pytest.raises(EngineDeadError, match="draining"):
            async for _ in gen:
                pass
        assert aengine.stats().blocks_used == 0
        aengine.shutdown()
        with pytest.raises(EngineDeadError):
            await aengine.submit(lambda e: None)
        with pytest.raises(EngineDeadError):
            async for _ in aengine.generate(GenerateRequest(prompt_token_ids=[1, 2], params=params)):
                pass

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))
