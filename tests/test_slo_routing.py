"""Routing by latency objectives (issue 52, second slice): each replica's step model learned from
its heartbeats (router/latency_model.py), the `slo` policy that routes requests with objectives
by headroom (router/slo_policy.py), and one live stack of sim replicas where a request with
objectives is routed by it, audited with reason `slo`, and its prediction's coverage measured.

Pure tests use fixed seeds and given samples; the live one waits on events (the audit file, the
gateway's /metrics) with hang guards only: no wall-clock thresholds."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import replace

import httpx
import numpy as np
import pytest

from replica.backends.sim_engine import SimEngine, SimEngineConfig
from router.decider import Decider, InflightPrefixes
from router.index.redis_index import Lookup, RedisConfig, RedisIndex, ReplicaEntry
from router.latency_model import MIN_SAMPLES, LatencyModels, StepFit, fit_steps, predict
from router.load_table import LoadTable
from router.policy import ReplicaView, RouteRequest, make_policy
from router.protocol.messages import (
    GenerateRequest,
    RouteDecision,
    StartChunk,
    checked_request,
    decode_chunk,
    encode_chunk,
)
from router.protocol.redis_schema import queued_by_priority
from router.protocol.sampling import SamplingParams
from router.protocol.slo import LatencyPrediction, Objectives
from router.slo_policy import SloPolicy, prediction_of, violation, with_objectives
from tests.helpers.slo import ask, metric_sum
from tests.helpers.stack import wait_until

BS = 16
TRUE = np.array([0.004, 0.0002, 0.0005, 2e-7, 0.03])  # base, per prefill token, per row, per context token, per start


def samples(rng: np.random.Generator, n: int, noise) -> np.ndarray:
    """Sample rows as the ring buffer holds them: prefill, rows, context, started, seconds, steps."""
    prefill = rng.uniform(0, 2000, n)
    rows = rng.integers(0, 64, n).astype(float)
    context = rows * rng.uniform(100, 4000, n)
    started = rng.uniform(0, 2, n)
    x = np.column_stack([np.ones(n), prefill, rows, context, started])
    seconds = x @ TRUE + noise(n)
    return np.column_stack([prefill, rows, context, started, seconds, np.full(n, 4.0)])


# ---- the model --------------------------------------------------------------------------------
def test_the_fit_recovers_a_known_linear_step_time():
    rng = np.random.default_rng(0)
    fit = fit_steps(samples(rng, 128, lambda n: rng.uniform(-1e-4, 1e-4, n)), budget=2048)
    assert fit is not None and fit.samples == 128
    assert np.allclose(fit.coef, TRUE, rtol=0.05, atol=2e-4), fit.coef
    assert 0 < fit.q <= 1e-4


def test_the_p90_covers_about_nine_in_ten_held_out_samples():
    """Split-conformal: fitted on 600 samples of gamma-distributed noise (its p90 unknown to the
    model), the p90 prediction covers 85-95% of 20,000 held-out samples of the same law (at this
    seed the calibration third has 200 samples: the coverage's sd is about 0.02)."""
    rng = np.random.default_rng(7)
    noise = lambda n: rng.gamma(2.0, 0.005, n)  # noqa: E731
    fit = fit_steps(samples(rng, 600, noise), budget=0)
    held = samples(rng, 20_000, noise)
    predicted = np.array([fit.step_s(*row[:4]) for row in held]) + fit.q
    coverage = float((held[:, 4] <= predicted).mean())
    assert 0.85 <= coverage <= 0.95, coverage


def _totals(models: LatencyModels, rid: str, n: int, rng: random.Random, start: list[int] | None = None) -> list[int]:
    """`n` heartbeat reads of a replica whose steps take 10 ms + 0.1 ms per row (+ noise)."""
    totals = start or [0] * 6
    for _ in range(n):
        steps, rows = rng.randint(2, 8), rng.randint(1, 30)
        us = steps * (10_000 + 100 * rows + rng.randint(0, 500))
        totals = [totals[0] + steps, totals[1] + us, totals[2], totals[3] + steps * rows,
                  totals[4] + steps * rows * 300, totals[5]]
        hb = dict(zip(("step_count", "step_us", "step_prefill_tokens", "step_rows", "step_context_tokens",
                       "step_started"), totals, strict=True))
        models.observe({rid: {**hb, "step_token_budget": 512}}, now=0.0)
    return totals


def test_learned_from_heartbeats_cold_until_enough_and_relearned_after_a_restart():
    models, rng = LatencyModels(refit_s=0.0), random.Random(1)
    totals = _totals(models, "r", MIN_SAMPLES, rng)  # the first read is no sample: one short
    models.refit(now=1.0)
    assert models.fit("r") is None and models.fit("unknown") is None
    _totals(models, "r", 1, rng, totals)
    models.refit(now=2.0)
    fit = models.fit("r")
    assert fit is not None and fit.budget == 512
    assert fit.step_s(0, 10, 3000, 0) == pytest.approx(0.011, rel=0.05)
    _totals(models, "r", 1, rng)  # totals back near zero: the replica restarted
    models.refit(now=3.0)
    assert models.fit("r") is None  # relearned from its new steps, not the old process's
    _totals(models, "r", MIN_SAMPLES, rng, [1, 1, 0, 1, 1, 0])
    models.refit(now=4.0)
    assert models.fit("r") is not None


def test_a_prediction_grows_with_the_work_ahead():
    fit = StepFit((0.01, 0.0002, 0.0005, 0.0, 0.02), q=0.002, prefill_per_step=100.0, started_per_step=0.1,
                  budget=512, samples=50)
    idle = predict(fit, uncached=500, prompt_tokens=500, running=0, waiting=0, pending_prefill=0, context=0)
    # 500 tokens in one 512-token step: base + prefill + its start + one residual quantile
    assert idle.ttft_s == pytest.approx(0.01 + 0.1 + 0.02 + 0.002)
    busy = predict(fit, uncached=500, prompt_tokens=500, running=20, waiting=4, pending_prefill=3000, context=9000)
    assert busy.ttft_s > idle.ttft_s and busy.tpot_s > idle.tpot_s


def test_a_request_waits_only_for_the_work_of_its_priority_and_better():
    """A replica whose queue is a flood's (priority 1): a request of priority 0 goes ahead of it
    there (the scheduler's (priority, arrival) order), so its TTFT counts none of that work; the
    flood's next request counts all of it. The batch either joins is the same."""
    fit = StepFit((0.01, 0.0002, 0.0005, 0.0, 0.02), q=0.002, prefill_per_step=100.0, started_per_step=0.1,
                  budget=512, samples=50)
    view = ReplicaView("r", running=8, waiting=20, pending_prefill_tokens=30_000, queued_by_priority="1:20:30000",
                       step_fit=fit)
    quiet = prediction_of(RouteRequest([], 64, BS, priority=0), view)
    flood = prediction_of(RouteRequest([], 64, BS, priority=1), view)
    assert quiet.ttft_s < 0.15 < 5.0 < flood.ttft_s and quiet.tpot_s == flood.tpot_s
    blind = replace(view, queued_by_priority="")  # a replica that gives no breakdown: all of it
    assert prediction_of(RouteRequest([], 64, BS, priority=0), blind).ttft_s == flood.ttft_s


def test_the_engine_reports_its_queue_by_priority():
    """Our engine core's breakdown (the heartbeat's queued_by_priority), here the sim engine's: after
    one 64-token step, the priority-0 prompt has run (one decode token left) and the first
    priority-1 prompt has its first chunk; two more wait."""
    engine = SimEngine(SimEngineConfig(max_num_batched_tokens=64, time_scale=100.0))
    for i, (n, priority) in enumerate([(100, 1), (100, 1), (100, 1), (40, 0)]):
        engine.add(GenerateRequest(prompt_token_ids=[100 * i + k + 1 for k in range(n)],
                                   params=SamplingParams(max_tokens=4, ignore_eos=True), priority=priority))
    engine.step()
    stats = engine.stats()
    assert stats.queued_by_priority == {0: (0, 1), 1: (2, 276)}
    assert queued_by_priority(stats.queued_by_priority) == "0:0:1 1:2:276"
    assert stats.pending_prefill_tokens == 277


# ---- the policy -------------------------------------------------------------------------------
FIT = StepFit((0.01, 0.0002, 0.0005, 0.0, 0.02), q=0.002, prefill_per_step=64.0, started_per_step=0.1,
              budget=512, samples=50)


def _route(objectives: Objectives | None, tokens: int = 512, hashes: int = 32) -> RouteRequest:
    return RouteRequest(list(range(hashes)), tokens, BS, objectives=objectives)


def test_a_replica_predicted_to_meet_wins_over_the_holder_that_would_miss():
    """The holder of the whole prompt has a deep queue: affinity keeps it (its queue costs less than
    the prefill it saves), but its predicted TTFT misses 600 ms; the idle replica meets it."""
    holder = ReplicaView("holder", matched_blocks=128, running=8, waiting=6, pending_prefill_tokens=2500, step_fit=FIT)
    idle = ReplicaView("idle", step_fit=FIT)
    base = make_policy("affinity", seed=0)
    assert base.decide(_route(None, 2048, 128), [holder, idle]).replica_id == "holder"
    slo = SloPolicy(make_policy("affinity", seed=0))
    d = slo.decide(_route(Objectives(ttft_ms=600), 2048, 128), [holder, idle])
    assert (d.replica_id, d.policy, d.reason) == ("idle", "slo", "slo")
    assert d.prediction is not None and d.prediction.ttft_ms <= 600
    # a loose objective both meet: today's choice, today's reason, with the prediction
    loose = slo.decide(_route(Objectives(ttft_ms=60_000), 2048, 128), [holder, idle])
    assert (loose.replica_id, loose.policy, loose.reason) == ("holder", "slo", "prefix")


def test_least_violation_when_none_can_meet():
    a = ReplicaView("a", running=40, waiting=10, pending_prefill_tokens=8000, step_fit=FIT)
    b = ReplicaView("b", running=10, waiting=2, pending_prefill_tokens=2000, step_fit=FIT)
    c = ReplicaView("c", running=30, waiting=5, pending_prefill_tokens=4000, step_fit=FIT)
    d = SloPolicy(make_policy("affinity-pull", seed=0)).decide(_route(Objectives(ttft_ms=1, tpot_ms=1)), [a, b, c])
    assert (d.replica_id, d.reason) == ("b", "slo")
    assert violation(predict(FIT, uncached=512, prompt_tokens=512, running=10, waiting=2, pending_prefill=2000,
                             context=0), Objectives(1, 1)) > 0


def test_cold_or_stale_everywhere_decides_as_today():
    views = [ReplicaView("a", matched_blocks=8, running=3), ReplicaView("b", running=1)]  # no step model anywhere
    want = make_policy("affinity-pull", seed=0).decide(_route(None), views)
    got = SloPolicy(make_policy("affinity-pull", seed=0)).decide(_route(Objectives(ttft_ms=1)), views)
    assert got == want and got.prediction is None


def test_a_cold_replica_counts_as_meeting():
    hot = ReplicaView("hot", matched_blocks=32, running=40, waiting=10, pending_prefill_tokens=8000, step_fit=FIT)
    new = ReplicaView("new")  # restarted: no model yet, gets traffic to learn from
    d = SloPolicy(make_policy("affinity", seed=0)).decide(_route(Objectives(ttft_ms=200)), [hot, new])
    assert (d.replica_id, d.policy, d.prediction) == ("new", "slo", None)  # today's choice too: reason `load`
    # a cold replica beside one predicted to meet: both candidates, today's costs choose
    calm = ReplicaView("calm", step_fit=FIT)
    d = SloPolicy(make_policy("affinity", seed=0)).decide(_route(Objectives(ttft_ms=60_000)), [calm, new])
    assert d.replica_id in ("calm", "new") and d.reason != "slo"


def _random_views(rng: random.Random, n: int) -> list[ReplicaView]:
    return [ReplicaView(f"r{i}", matched_blocks=rng.choice([0, 0, 4, 16, 32]), running=rng.randint(0, 30),
                        waiting=rng.randint(0, 8), pending_prefill_tokens=rng.randint(0, 4000),
                        kv_pull=rng.random() < 0.7, context_tokens=rng.randint(0, 20_000),
                        step_fit=FIT if rng.random() < 0.8 else None) for i in range(n)]


@pytest.mark.parametrize("base", ["affinity-pull", "affinity"])
def test_without_objectives_every_decision_is_todays(base):
    """The same random cases (warm and cold models, sessions, pulls) through the default policy and
    through it wrapped by `slo`: identical decisions, the same seed's draws, the same commits."""
    rng = random.Random(52)
    today, wrapped = make_policy(base, seed=3), with_objectives(make_policy(base, seed=3))
    assert isinstance(wrapped, SloPolicy)
    for i in range(300):
        views = _random_views(rng, rng.randint(1, 9))
        session = rng.choice([None, views[0].replica_id, "gone"])
        tokens = rng.randint(20, 2000)
        route = RouteRequest(list(range(rng.randint(0, 64))), tokens, BS, session_id=f"s{i}")
        a, b = today.choose(route, views, session), wrapped.choose(replace_route(route), views, session)
        assert a == b, (i, a, b)
        assert today.rank(route, views) == wrapped.rank(route, views)


def replace_route(route: RouteRequest) -> RouteRequest:
    return RouteRequest(list(route.block_hashes), route.num_prompt_tokens, route.block_size, route.session_id)


def test_only_the_affinity_policies_are_wrapped():
    assert isinstance(with_objectives(make_policy("affinity-pull")), SloPolicy)
    assert not isinstance(with_objectives(make_policy("least-loaded")), SloPolicy)


# ---- through the router's pieces ----------------------------------------------------------------
def test_the_decider_hands_the_model_only_with_a_fresh_heartbeat():
    """Warm models in the load table reach the views; once the table is stale (Redis away), the views
    carry none and the decision is today's."""
    table = LoadTable(RedisIndex(RedisConfig("redis://127.0.0.1:1/0", timeout_s=0.01)), refresh_s=60.0, seed=0)
    table._loads = {rid: {"running": 1, "waiting": 0, "pending_prefill_tokens": 0, "context_tokens": 100}
                    for rid in ("a", "b")}
    table.updated_at = time.monotonic()
    rng = random.Random(0)
    for rid in ("a", "b"):
        _totals(table.latency, rid, MIN_SAMPLES + 1, rng)
    table.latency.refit(now=0.0)
    decider = Decider(SloPolicy(make_policy("affinity-pull", seed=0)), table, InflightPrefixes(3.0), sampled=4)
    route = _route(Objectives(ttft_ms=60_000), tokens=256, hashes=16)

    async def score():
        try:
            return decider.score(route, ["a", "b"], Lookup(None, {"a": ReplicaEntry(4)}), lambda rid: 0)
        finally:
            await table.close()

    routed = asyncio.run(score())
    assert all(v.step_fit is not None for v in routed.views) and routed.decision.policy == "slo"
    assert routed.decision.prediction is not None
    table.updated_at -= table.max_age_s + 1  # no refresh for longer than max_age_s
    stale = asyncio.run(score())
    assert all(v.step_fit is None for v in stale.views)
    assert stale.decision.prediction is None and stale.decision.policy == "affinity-pull"


def test_objectives_and_predictions_cross_processes_typed():
    req = GenerateRequest(prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=4),
                          objectives=Objectives(ttft_ms=200))
    assert checked_request(req).objectives == Objectives(ttft_ms=200)
    chunk = StartChunk("r", RouteDecision("slo", "slo", "r", prediction=LatencyPrediction(120.5, 30.0)))
    assert decode_chunk(encode_chunk(chunk)).route.prediction == LatencyPrediction(120.5, 30.0)
    assert chunk.route.as_dict()["predicted_ttft_ms"] == 120.5


# ---- a live stack of sim replicas ----------------------------------------------------------------
APP = "slo-routing"
SIM_SERVICE = {"prefill_overhead_s": 0.05, "decode_step_s": 0.01}


@pytest.fixture(scope="module")
def slo_routing_app(stack, tmp_path_factory):
    from gateway.config import AppConfig
    from tests.helpers.stack import side_app

    audit = tmp_path_factory.mktemp("slo-audit")
    args = {"redis_url": stack.config.redis_url, "key_prefix": f"slor-{uuid.uuid4().hex[:6]}", "engine": "sim",
            "replicas": 2, "num_blocks": 256, "block_size": 16, "max_model_len": 4096, "redis_timeout_s": 1.0,
            "sim_service": SIM_SERVICE, "audit_dir": str(audit),
            "slo_shed": False}  # routed, not refused: shedding is tests/test_slo_admission.py's
    with side_app(stack, APP, AppConfig.from_dict(args)) as url:
        yield url, audit


def test_a_request_with_objectives_is_routed_by_headroom_live(slo_routing_app):
    """Requests with a 1 ms TTFT objective (no replica can meet it) once the replicas' step models
    are warm: decided by `slo` with the least violation (reason `slo` in the audit), the
    prediction back in the response, and its coverage counted by the gateway."""
    from router.protocol.audit_log import Decision, read_dir

    url, audit = slo_routing_app
    headers = {"x-slo-ttft-ms": "1", "x-slo-tpot-ms": "3600000"}
    # a prompt of its own: the module's other live test sends loose objectives (decisions by `slo`
    # with today's reasons), told apart in the audit by their prompt's length
    own = [{"role": "user", "content": "Name three rivers that cross more than two countries, please."}]
    prompt_tokens = 0

    def routed_by_slo() -> dict | None:
        nonlocal prompt_tokens
        ask(url, "none", max_tokens=16)  # work for the step models to learn from, without objectives
        answer = ask(url, "none", headers, max_tokens=4, messages=own)
        assert answer.status_code == 200, answer.text
        prompt_tokens = answer.json()["usage"]["prompt_tokens"]
        route = answer.json()["prefixgate"]["route"]
        return route if route["policy"] == "slo" and "predicted_ttft_ms" in route else None

    route = wait_until("a decision by the slo policy with a prediction", routed_by_slo, timeout_s=300)
    assert route["reason"] == "slo" and route["predicted_ttft_ms"] > 1

    def audited() -> list[Decision]:
        return [r for r in read_dir(audit) if isinstance(r, Decision) and r.route.policy == "slo"
                and r.route.prediction is not None and r.prompt_tokens == prompt_tokens] or None

    decisions = wait_until("the slo decision in the routing audit", audited, timeout_s=120)
    assert {d.route.reason for d in decisions} == {"slo"}

    def covered() -> str | None:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        return text if metric_sum(text, "prefixgate_slo_predictions_total", objective="ttft") >= 1 else None

    text = wait_until("a prediction judged by the gateway", covered, timeout_s=120)
    # a 1 ms objective is missed; whether the p90 covered the TTFT is the model's business: the
    # series exist, covered never exceeds judged
    for objective in ("ttft", "tpot"):
        judged = metric_sum(text, "prefixgate_slo_predictions_total", objective=objective)
        assert 0 <= metric_sum(text, "prefixgate_slo_prediction_covered_total", objective=objective) <= judged
    assert metric_sum(text, "prefixgate_slo_prediction_ratio_count", objective="ttft") >= 1
    assert metric_sum(text, "prefixgate_route_slo_decisions_total", outcome="violated") >= 1
    assert metric_sum(text, "prefixgate_route_slo_headroom_count", objective="ttft") >= 1


def test_the_gateways_observations_recalibrate_the_routers_p90_live(slo_routing_app):
    """The loop across the real process layout: the gateway judges each request with objectives
    against the decision's prediction and feeds it back (router/latency_calibration.py); once
    it has MIN_OBSERVED of them, the router's decisions say their p90 is calibrated, and their
    mean is carried beside it."""
    from router.latency_calibration import MIN_OBSERVED

    url, _ = slo_routing_app
    headers = {"x-slo-ttft-ms": "60000", "x-slo-tpot-ms": "60000"}
    sent = 0

    def calibrated() -> dict | None:
        nonlocal sent
        answer = ask(url, "none", headers, max_tokens=4)
        assert answer.status_code == 200, answer.text
        sent += 1
        route = answer.json()["prefixgate"]["route"]
        return route if route.get("prediction_calibrated") else None

    route = wait_until("a decision whose p90 comes from the gateway's observations", calibrated, timeout_s=300)
    assert sent > MIN_OBSERVED // 2  # not before the gateway had judged requests with predictions
    assert route["policy"] == "slo" and route["predicted_ttft_ms"] > 0
