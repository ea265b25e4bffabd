"""The simulated-compute engine: real cache and scheduler, modelled time, no torch.

Pure-logic tests (no Ray, no Redis): fast. The live stack with sim replicas is in
tests/test_light_processes.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time

import pytest

from replica.async_engine import AsyncLLMEngine
from replica.backends.sim_engine import SimEngine, StepLag, fake_token_text
from replica.core.engine_types import InvalidRequestError
from replica.engine_config import SimEngineConfig
from router.costs.service import ServiceModel
from router.index.memory_index import InMemoryIndex
from router.protocol.messages import GenerateRequest
from router.protocol.sampling import SamplingParams
from router.sim.replica import Job, SimReplica
from router.sim.trace import prompt_tokens, scale_rows

FAST = 1000.0  # time scale for tests that check accounting, not wall time


def engine(**kw) -> SimEngine:
    kw.setdefault("time_scale", FAST)
    return SimEngine(SimEngineConfig(**kw))


def test_imports_no_torch():
    """A sim replica, the replica deployment and the gateway modules load neither torch nor the
    real engine (checked in a fresh interpreter)."""
    code = textwrap.dedent("""
        import sys
        import replica.backends.sim_engine, replica.serve.deployment, gateway.server, gateway.app, gateway.tokenization
        from replica.serve.replica_settings import ReplicaSettings
        ReplicaSettings.from_dict({"engine": {"engine": "sim", "config": {"num_blocks": 8}}})
        heavy = sorted(m for m in ("torch", "replica.engine", "replica.model.model_runner", "replica.model.sampler") if m in sys.modules)
        print(heavy)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_fake_tokens_are_deterministic_in_vocab_and_never_eos():
    e = engine(vocab_size=5, eos_token_ids=[0, 1, 2])
    prompt = [3, 4, 3, 4]
    a, b = e.generate([prompt, prompt], SamplingParams(max_tokens=20))
    assert a.token_ids == b.token_ids  # same prompt, same answer (like greedy decoding)
    assert set(a.token_ids) <= {3, 4} and a.finish_reason == "length" and len(a.token_ids) == 20
    assert a.text == "".join(fake_token_text(t) for t in a.token_ids) and a.text.isprintable()
    e2 = engine()
    x, y = e2.generate([[7, 8, 9], [7, 8, 10]], SamplingParams(max_tokens=8))
    assert x.token_ids != y.token_ids and all(0 <= t < 49152 for t in x.token_ids + y.token_ids)


def test_stop_strings_and_stop_ids():
    e = engine()
    prompt = list(range(100, 140))
    [full] = e.generate([prompt], SamplingParams(max_tokens=12))
    word = fake_token_text(full.token_ids[5]).strip()
    [cut] = e.generate([prompt], SamplingParams(max_tokens=12, stop=[word]))
    assert cut.finish_reason == "stop" and word not in cut.text and full.text.startswith(cut.text)
    [no_stop_id] = e.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=[full.token_ids[0]]))
    assert full.token_ids[0] not in no_stop_id.token_ids  # a fake answer never emits a stop id


def test_refuses_bad_input():
    e = engine(num_blocks=4, block_size=16, vocab_size=100, max_model_len=80)
    for prompt, params in (
        ("text", SamplingParams()),
        ([], SamplingParams()),
        ([100], SamplingParams()),
        ([1] * 70, SamplingParams(max_tokens=20)),  # beyond the context
        ([1] * 60, SamplingParams(max_tokens=10)),  # beyond the pool (4 blocks of 16)
    ):
        with pytest.raises(InvalidRequestError):
            e.add_request(prompt, params)
    assert not e.has_unfinished


def test_cache_hits_events_and_preemption():
    stored: list[int] = []

    class Listener:
        def stored(self, hashes, positions):
            stored.extend(hashes)

        def removed(self, hashes):
            pass

        def cleared(self):
            pass

    e = engine(block_size=16, num_blocks=64)
    e.add_listener(Listener())
    turn1 = list(range(1000, 1100))
    [a] = e.generate([turn1], SamplingParams(max_tokens=10))
    assert a.num_cached_tokens == 0 and len(stored) == 110 // 16  # prompt and output blocks
    turn2 = turn1 + a.token_ids + [5, 6, 7]
    [b] = e.generate([turn2], SamplingParams(max_tokens=4))
    assert b.num_cached_tokens == 96  # every full block of turn 1's prompt and answer
    # a pool too small for everyone at once: preemption, yet every request completes
    tight = engine(block_size=16, num_blocks=12, max_num_batched_tokens=64)
    outs = tight.generate([[i] * 40 for i in range(1, 7)], SamplingParams(max_tokens=60))
    assert all(o.finish_reason == "length" and len(o.token_ids) == 60 for o in outs)
    assert tight.stats().preemptions > 0 and tight.blocks.num_used == 0


def test_step_time_follows_the_service_model():
    """A lone request's modelled prefill equals the simulator's prefill_s, and each further
    token one decode step."""
    service = {"prefill_s_per_token": 1e-4, "prefill_overhead_s": 0.02, "decode_step_s": 0.025, "decode_s_per_seq": 5e-4}
    e = engine(block_size=16, num_blocks=256, max_num_batched_tokens=256, service=service)
    sm = e.service
    [out] = e.generate([list(range(1, 1001))], SamplingParams(max_tokens=1))
    assert e.lag.steps == 4  # 1000 prompt tokens in chunks of 256
    assert e.lag.modelled_s * FAST == pytest.approx(sm.prefill_s(1000, 0))
    before = e.lag.modelled_s
    [out] = e.generate([list(range(2001, 2101))], SamplingParams(max_tokens=5))
    assert (e.lag.modelled_s - before) * FAST == pytest.approx(sm.prefill_s(100, 0) + 4 * sm.step_s(1))
    # a step with decodes and a prefill chunk costs both
    assert sm.engine_step_s(3, 100, 1) == pytest.approx(sm.step_s(3) + 100 * 1e-4 + 0.02)


def test_sleeps_rather_than_spins():
    """The modelled step time passes in a sleep: the engine thread uses little CPU meanwhile."""
    e = SimEngine(SimEngineConfig(service={"decode_step_s": 0.15}))
    e.add_request([1, 2, 3], SamplingParams(max_tokens=3))
    cpu0 = time.thread_time()
    while e.has_unfinished:
        e.step()
    cpu = time.thread_time() - cpu0
    assert e.lag.modelled_s >= 0.3  # two decode steps of 0.15 s (the first step is the prefill)
    assert cpu < e.lag.modelled_s / 4  # that time passed asleep: a spin would burn it as CPU


def test_step_lag_is_reported_when_steps_run_late():
    """A slow listener (e.g. a publisher starved of CPU) makes steps overrun their model."""

    class SlowListener:
        def stored(self, hashes, positions):
            time.sleep(0.05)

        def removed(self, hashes):
            pass

        def cleared(self):
            pass

    e = SimEngine(SimEngineConfig(block_size=4, service={"decode_step_s": 0.005, "decode_s_per_seq": 0.0}))
    e.add_listener(SlowListener())
    e.generate([[5, 6, 7]], SamplingParams(max_tokens=12))  # fills blocks: stored events each 4 tokens
    lag = e.step_lag()
    assert lag["steps"] == 12 and lag["steps_over_10pct"] >= 2 and lag["max_ratio"] > 2 and not lag["valid"]


def test_step_lag_summary():
    lag = StepLag()
    for _ in range(98):
        lag.record(0.01, 0.0101)
    lag.record(0.01, 0.02)
    lag.record(0.01, 0.05)
    s = lag.summary()
    assert s["steps"] == 100 and s["steps_over_10pct"] == 2
    assert s["p50_ratio"] == pytest.approx(1.02) and s["p99_ratio"] >= 2.0 and s["max_ratio"] == pytest.approx(5.0)


def test_plugs_into_async_engine():
    async def main():
        a = AsyncLLMEngine(engine(block_size=16, num_blocks=64))
        try:
            outs = [o async for o in a.generate(GenerateRequest(prompt_token_ids=list(range(50)), params=SamplingParams(max_tokens=6)))]
            return outs, a.stats()
        finally:
            a.shutdown()

    outs, stats = asyncio.run(main())
    assert len(outs) == 6 and outs[-1].finished and outs[-1].metrics is not None
    assert "".join(o.new_text for o in outs) == outs[-1].text and stats.generated_tokens == 6


def test_same_rows_as_the_simulator():
    """Anti-drift: trace rows, mapped to tokens as the live replay maps them, hit the same
    blocks in the sim engine as in the simulator's replica (one at a time, ample capacity), and
    the engine's modelled time to first token equals the simulator's prefill time."""
    bs = 16
    rows = [
        {"timestamp": 0, "hash_ids": [1, 2, 3], "output_length": 5},
        {"timestamp": 1, "hash_ids": [1, 2, 4, 5], "output_length": 3},
        {"timestamp": 2, "hash_ids": [1, 2, 3, 6, 7], "output_length": 4},
        {"timestamp": 3, "hash_ids": [8, 9], "output_length": 2},
        {"timestamp": 4, "hash_ids": [1, 2, 4, 5, 10, 11], "output_length": 6},
        {"timestamp": 5, "hash_ids": [8, 9, 12], "output_length": 1},
    ]
    reqs = scale_rows(rows, bs, max_output=8)
    e = engine(block_size=bs, num_blocks=512, max_num_batched_tokens=4096)
    service: ServiceModel = e.service
    rep = SimReplica("r0", 512, bs, service, InMemoryIndex())
    for i, req in enumerate(reqs):
        before = e.lag.modelled_s
        [out] = e.generate([prompt_tokens(req, i, bs)], SamplingParams(max_tokens=1))
        ttft_engine = (e.lag.modelled_s - before) * FAST
        job = Job(req, 0.0, 0, 0)
        rep.enqueue(job)
        end = rep.try_start(0.0)
        done, _ = rep.prefill_done(end)
        rep.finish(done)
        assert out.num_cached_tokens == done.hit_blocks * bs, f"row {i}"
        assert ttft_engine == pytest.approx(end), f"row {i}"
    assert e.stats().cached_tokens == rep.bm.stats.hit_tokens


def test_adapters_in_host_memory_are_modelled_as_the_simulator_does():
    """max_cpu_loras 1: a request under an adapter not resident waits for its read (it is not
    queued for the scheduler until then) and evicts the other; the stats report the resident
    identity and the modelled read time, as a live replica's heartbeat does (0 before a read)."""
    from router.protocol.lora import AdapterRef

    e = engine(max_loras=1, max_cpu_loras=1, lora_load_ms=40.0)
    a, b = (AdapterRef(name=n, path=f"/adapters/{n}", digest=n * 8) for n in ("a", "b"))
    e.add_adapter(a)
    e.add_adapter(b)
    assert e.stats().lora_resident == [] and e.stats().lora_load_s == 0.0
    params = SamplingParams(max_tokens=2)
    first = e.add_request(list(range(100, 140)), params, adapter="a")
    assert [seq.request_id for _, seq, _ in e._pulling] == [first] and not e.scheduler.has_work
    while e.has_unfinished:
        e.step()
    assert e.stats().lora_resident == [a.identity] and e.stats().lora_load_s == pytest.approx(0.04)
    e.add_request(list(range(100, 140)), params, adapter="a")  # resident: straight to the scheduler
    assert not e._pulling and e.scheduler.has_work
    while e.has_unfinished:
        e.step()
    e.add_request(list(range(200, 240)), params, adapter="b")  # read, and `a` leaves host memory
    assert len(e._pulling) == 1
    while e.has_unfinished:
        e.step()
    assert e.stats().lora_resident == [b.identity] and e.adapter_memory.loads == 2
