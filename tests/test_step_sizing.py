"""Steps sized to latency objectives (replica/core/step_sizing.py): the step model learned from the
engine's own steps, the prefill cap beside a row with a TPOT objective (by what it has banked),
the urgent request first, no cap for TTFT objectives, and nothing changed without objectives.
Pure logic on the tensor-free scheduler; the last test runs the sim engine (our engine core,
modelled compute) with objectives."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from replica.backends.sim_engine import ManualClock, SimEngine, SimEngineConfig
from replica.core.scheduler import Scheduler, SchedulerConfig
from replica.core.sequence import Sequence
from replica.core.step_sizing import MIN_PREFILL_TOKENS, StepSizer
from replica.core.step_timings import StepTotals
from replica.kvcache.block_manager import BlockManager
from router.latency_model import MIN_SAMPLES, StepFit
from router.protocol.hashing import block_hashes
from router.protocol.messages import GenerateRequest
from router.protocol.sampling import SamplingParams
from router.protocol.slo import Objectives

BS = 4
BUDGET = 256
CLOCK = ManualClock(1000.0)  # the schedulers' clock: it stands still, so deadlines hold on a busy machine
# a known step model: 2 ms a step, 0.1 ms a prefill token, 1 ms a decode row, nothing per context token
FIT = StepFit((0.002, 1e-4, 1e-3, 0.0, 0.0), q=0.001, prefill_per_step=0.0, started_per_step=0.0,
              budget=BUDGET, samples=64)


def _seq(n: int, *, first: int = 1000, ttft_ms: int | None = None, tpot_ms: int | None = None,
         priority: int = 0) -> Sequence:
    tokens = list(range(first, first + n))
    seq = Sequence(tokens, SamplingParams(max_tokens=64, ignore_eos=True), hash_seed=0)
    seq.table.hashes = block_hashes(tokens, BS, 0)
    seq.arrival_time = CLOCK()
    seq.ttft_s = ttft_ms / 1000 if ttft_ms is not None else None
    seq.tpot_s = tpot_ms / 1000 if tpot_ms is not None else None
    seq.priority = priority
    return seq


def _scheduler(fit: StepFit | None = FIT) -> Scheduler:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=BUDGET), BlockManager(1024, BS), clock=CLOCK)
    if fit is not None:
        sched.sizer.models.fit = lambda replica_id: fit  # the model the engine would have learned
    return sched


def _step(sched: Scheduler):
    """One step as the engine core runs it: schedule, commit, a token where one is sampled."""
    chunks = sched.schedule()
    sched.commit(chunks)
    for c in chunks:
        if c.samples:
            c.seq.token_ids.append(7)
            if c.seq.first_token_time is None:
                c.seq.first_token_time = CLOCK()
    return chunks


def _prefill(chunks) -> int:
    return sum(c.end - c.start for c in chunks if c.end - c.start > 1 or c.start < c.seq.num_prompt_tokens)


def test_the_step_model_is_learned_from_the_engines_own_steps():
    sizer = StepSizer(BUDGET)
    totals = StepTotals()
    now = 0.0
    for i in range(4 * MIN_SAMPLES):
        prefill, rows = (i * 37) % 200, 1 + (i * 11) % 16
        totals.record(FIT.step_s(prefill, rows, 0, 0), prefill, rows, 0, 0)
        now += 0.25  # refitted every REFIT_S of this clock
        sizer.learn(totals, now)
    fit = sizer.fit
    assert fit is not None
    assert fit.coef[1] == pytest.approx(1e-4, rel=0.01) and fit.coef[2] == pytest.approx(1e-3, rel=0.01)


def test_without_objectives_the_step_takes_the_whole_budget():
    sched = _scheduler()
    running = _seq(8, first=10)
    sched.add(running)
    _step(sched)  # it decodes from now on
    long = _seq(600)
    sched.add(long)
    chunks = _step(sched)
    assert sched.sizer.prefill_cap(sched.running, CLOCK()) is None
    assert _prefill(chunks) == BUDGET - 1  # the decode row takes one token of the budget


def test_a_tpot_objective_caps_the_prefill_beside_its_row():
    sched = _scheduler()
    row = _seq(8, first=10, tpot_ms=20)
    sched.add(row)
    _step(sched)
    long = _seq(600)
    sched.add(long)
    chunks = _step(sched)
    # 20 ms = 2 ms + 1 ms (one row) + 1 ms (the p90 residual) + 0.1 ms per prefill token
    assert _prefill(chunks) == math.floor((0.020 - 0.002 - 0.001 - 0.001) / 1e-4) == 160
    assert any(c.seq is row for c in chunks)  # the row decodes in the capped step
    sched.finish(row, "stop")  # the objective leaves with its request
    assert _prefill(_step(sched)) == BUDGET


def test_an_objective_no_step_can_meet_still_leaves_prefills_a_minimum():
    sched = _scheduler()
    row = _seq(8, first=10, tpot_ms=1)  # a decode step alone takes 4 ms
    sched.add(row)
    _step(sched)
    sched.add(_seq(600))
    assert _prefill(_step(sched)) == MIN_PREFILL_TOKENS


def test_a_row_ahead_of_its_objective_lets_a_step_run_longer():
    """TPOT is the request's mean: a row that has banked time (its tokens came faster than the
    objective) lets the next step spend it; a row behind gets a step of its objective, never
    less (prefills are not starved to make it catch up)."""
    sched = _scheduler()
    row = _seq(8, first=10, tpot_ms=20)
    sched.add(row)
    _step(sched)
    row.token_ids += [7] * 9  # ten tokens out: nine intervals, ten after the next step
    now = CLOCK()
    row.first_token_time = now - 0.050  # 200 ms allowed for ten intervals, 50 spent: 150 ms banked
    assert sched.sizer.prefill_cap(sched.running, now) == BUDGET  # (150 - 4) / 0.1 ms: over the budget
    row.first_token_time = now - 1.0  # behind: a 20 ms step, as for a fresh row
    assert sched.sizer.prefill_cap(sched.running, now) == 160


def test_ttft_objectives_cap_no_step():
    sched = _scheduler()
    sched.add(_seq(600))
    waiting = _seq(8, first=10, ttft_ms=100)
    sched.add(waiting)
    waiting.arrival_time -= 0.090  # 10 ms left: urgent, but the step is not cut for it
    assert sched.sizer.prefill_cap(sched.running, CLOCK()) is None
    assert sched.sizer.urgent(CLOCK()) is waiting


def test_an_urgent_request_is_served_first_among_its_priority():
    sched = _scheduler()
    long = _seq(2000)  # a running prefill, no objective
    sched.add(long)
    _step(sched)
    earlier = _seq(40, first=5000)  # waiting, no objective, arrived first
    sched.add(earlier)
    urgent = _seq(40, first=9000, ttft_ms=60)
    sched.add(urgent)
    urgent.arrival_time -= 0.030  # 30 ms left: within two full steps (2 x (2 + 25.6 + 1) ms)
    higher = _seq(40, first=7000, priority=-1)  # a higher priority still goes before it
    sched.add(higher)
    chunks = _step(sched)
    # the higher priority first, then the urgent one; the running prefill and the earlier
    # arrival of the urgent one's priority yield this step to them
    assert [c.seq for c in chunks] == [higher, urgent]
    assert urgent.first_token_time is not None and earlier.num_computed == 0


def test_no_urgency_without_objectives():
    sched = _scheduler()
    long = _seq(2000)
    sched.add(long)
    _step(sched)
    first, second = _seq(40, first=5000), _seq(40, first=9000)
    sched.add(first)
    sched.add(second)
    chunks = _step(sched)
    assert [c.seq for c in chunks][:1] == [long]  # arrival order: the running prefill first


def _request(n: int, first: int, max_tokens: int, objectives: Objectives | None = None) -> GenerateRequest:
    rng = random.Random(first)  # distinct prompts: no cache hits between them
    return GenerateRequest(prompt_token_ids=[rng.randrange(100, 40_000) for _ in range(n)],
                           params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), objectives=objectives)


class _Recorder:
    """The sim engine's executor, recording each step's prefill tokens, modelled time and rows."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine, self.inner = engine, engine.executor
        self.steps: list[tuple[int, float, set[str]]] = []

    def execute(self, chunks, admitted):
        modelled = self.engine.modelled_step_s(chunks, admitted) / self.engine.config.time_scale
        decoding = {c.seq.request_id for c in chunks if c.end - c.start == 1 and c.start >= c.seq.num_prompt_tokens}
        self.steps.append((_prefill(chunks), modelled, decoding))
        return self.inner.execute(chunks, admitted)


def test_the_sim_engine_sizes_its_steps_to_a_tpot_objective():
    """Our engine core with modelled compute (25 ms a decode step, 0.14 ms a prompt token, run 4x
    faster) on a manual clock (every time it reads is the modelled one, so what it decides is the
    same on any machine), long prompts arriving all along: while a request with a 20 ms TPOT
    objective (sent as the gateway sends it, in GenerateRequest.objectives) decodes, the steps
    beside it carry fewer prefill tokens than the budget and its time per output token is within
    the objective; before it came, the steps took the whole budget and ran past 20 ms."""
    clock = ManualClock()
    engine = SimEngine(SimEngineConfig(time_scale=4.0, max_num_batched_tokens=512, num_blocks=8192,
                                       max_model_len=8192), clock=clock)
    recorder = engine.executor = _Recorder(engine)
    first = iter(range(1, 10_000))
    for _ in range(2000):  # bounded: the step model is fitted within a few hundred steps
        if engine.scheduler.sizer.fit is not None:
            break
        if len(engine.scheduler.waiting) < 2:  # the step model learns from these steps
            engine.add(_request(1500, next(first), 4))
        engine.step()
    assert engine.scheduler.sizer.fit is not None, "the engine learned no step model from its steps"
    assert max(p for p, _, _ in recorder.steps) == 512
    assert max(s for _, s, _ in recorder.steps) > 0.020  # unsized, the steps pass the objective
    row = _request(8, 0, 48, Objectives(tpot_ms=20))
    engine.add(row)
    seq = engine.requests[row.request_id]
    for _ in range(2000):
        if seq.is_finished:
            break
        if len(engine.scheduler.waiting) < 2:
            engine.add(_request(1500, next(first), 4))
        engine.step()
    assert seq.is_finished
    beside = [(p, s) for p, s, rows in recorder.steps if row.request_id in rows]
    assert len(beside) == 47  # every output token after the first
    # prefill goes on beside it, in smaller steps on average (a step banks time the ones before saved)
    assert min(p for p, _ in beside) > 0
    assert statistics.mean(p for p, _ in beside) < 0.8 * 511  # 511: the budget beside one decode
    tpot = (clock() - seq.first_token_time) / (seq.num_output_tokens - 1)
    assert tpot <= 0.020
