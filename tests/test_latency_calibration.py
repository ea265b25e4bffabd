"""The latency model's p90 recalibrated on the gateway's end-to-end observations
(router/latency_calibration.py): its coverage on held-out draws, the step model's p90 until
enough is observed, a changed regime followed, and the loop wired: the gateway's judged
requests feed the calibration the `slo` policy's decisions read. Fixed seeds, no clocks; the
live loop is tests/test_slo_routing.py's."""

from __future__ import annotations

import math
import uuid

import numpy as np

from gateway.slo_watch import SloWatch
from router.latency_calibration import MIN_OBSERVED, WINDOW, Calibration, calibration
from router.latency_model import StepFit
from router.policy import ReplicaView, RouteRequest, make_policy
from router.protocol.slo import LatencyPrediction, Objectives
from router.slo_policy import SloPolicy, prediction_of


def _draws(rng: np.random.Generator, n: int, overhead_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Mean predictions over two decades, and what is observed end to end: the mean times a noisy
    factor, plus hops the step model does not see."""
    mean = rng.uniform(0.01, 1.0, n)
    observed = mean * rng.lognormal(0.0, 0.3, n) + overhead_s * rng.uniform(0.5, 1.5, n)
    return mean, observed


def _coverage(c: Calibration, mean: np.ndarray, observed: np.ndarray, model_p90: np.ndarray) -> float:
    bounds = np.array([c.p90("ttft", m, p) for m, p in zip(mean, model_p90, strict=True)])
    return float(np.mean(observed <= bounds))


def test_the_calibrated_p90_covers_about_nine_in_ten_held_out_requests():
    rng = np.random.default_rng(0)
    c = Calibration()
    for m, o in zip(*_draws(rng, WINDOW, 0.04), strict=True):
        c.observe("ttft", m, o)
    mean, observed = _draws(rng, 4000, 0.04)
    step_model_p90 = mean * 1.05  # a step model's bound that sees no hops: it covers too little
    assert float(np.mean(observed <= step_model_p90)) < 0.7
    assert 0.85 <= _coverage(c, mean, observed, step_model_p90) <= 0.95


def test_the_step_models_p90_stands_until_enough_is_observed():
    rng = np.random.default_rng(1)
    c = Calibration()
    mean, observed = _draws(rng, MIN_OBSERVED, 0.04)
    for m, o in zip(mean[:-1], observed[:-1], strict=True):
        c.observe("ttft", m, o)
    assert not c.ready("ttft") and c.p90("ttft", 0.2, 0.25) == 0.25
    c.observe("ttft", mean[-1], observed[-1])
    assert c.ready("ttft") and c.p90("ttft", 0.2, 0.25) != 0.25
    assert not c.ready("tpot") and c.p90("tpot", 0.02, 0.03) == 0.03  # each objective its own


def test_a_changed_regime_is_followed_within_a_window():
    rng = np.random.default_rng(2)
    c = Calibration()
    for m, o in zip(*_draws(rng, WINDOW, 0.01), strict=True):
        c.observe("ttft", m, o)
    mean, observed = _draws(rng, 4000, 0.2)  # the hops grew twentyfold (a gateway moved away)
    assert _coverage(c, mean, observed, mean) < 0.8
    for m, o in zip(*_draws(rng, WINDOW, 0.2), strict=True):
        c.observe("ttft", m, o)
    assert 0.85 <= _coverage(c, mean, observed, mean) <= 0.95


def test_the_level_adapts_to_keep_nine_in_ten_covered_while_the_load_drifts():
    """The hops grow all along (a rising rate): a trailing window's p90 lags them; fed whether each
    request was covered, the level rises until nine in ten are again (adaptive conformal inference)."""

    def run(adapt: bool) -> tuple[float, float]:
        rng, c, covered = np.random.default_rng(0), Calibration(), []
        for t in range(1500):
            mean = rng.uniform(0.01, 1.0)
            observed = mean * rng.lognormal(0.0, 0.3) + (0.01 + 0.3 * t / 1500) * rng.uniform(0.5, 1.5)
            ready, bound = c.ready("ttft"), c.p90("ttft", mean, mean)
            if ready:
                covered.append(observed <= bound)
            c.observe("ttft", mean, observed, (observed <= bound) if adapt and ready else None)
        return float(np.mean(covered)), c.level("ttft")

    (plain, plain_level), (adaptive, level) = run(False), run(True)
    assert plain_level == 0.9 and plain < 0.88
    assert 0.88 <= adaptive <= 0.92 and level > 0.9


def test_observations_that_are_not_times_are_ignored():
    c = Calibration()
    for bad in ((-1.0, 0.1), (0.1, -1.0), (math.nan, 0.1), (0.1, math.inf)):
        c.observe("tpot", *bad)
    assert c.observed("tpot") == 0


FIT = StepFit((0.01, 0.0002, 0.0005, 0.0, 0.02), q=0.002, prefill_per_step=64.0, started_per_step=0.1,
              budget=512, samples=50)


def test_the_slo_policy_predicts_with_the_calibration_and_says_so():
    c = Calibration(min_observed=4)
    for _ in range(4):
        c.observe("ttft", 0.05, 0.5)  # observed ten times the mean: the p90 follows
    view = ReplicaView("a", step_fit=FIT)
    route = RouteRequest(list(range(8)), 128, 16, objectives=Objectives(ttft_ms=10_000))
    raw = prediction_of(route, view)
    calibrated = prediction_of(route, view, c)
    assert calibrated.ttft_mean_s == raw.ttft_mean_s and calibrated.ttft_s > 5 * raw.ttft_s
    assert calibrated.tpot_s == raw.tpot_s  # no TPOT observed yet: the step model's p90
    d = SloPolicy(make_policy("affinity", seed=0), c).decide(route, [view])
    assert d.prediction.ttft_calibrated and not d.prediction.tpot_calibrated
    assert d.prediction.ttft_ms == calibrated.ttft_s * 1000
    assert d.prediction.ttft_mean_ms == raw.ttft_mean_s * 1000 > 0
    plain = SloPolicy(make_policy("affinity", seed=0)).decide(route, [view])
    assert not plain.prediction.ttft_calibrated and plain.prediction.ttft_ms == raw.ttft_s * 1000


def test_a_judged_request_feeds_its_models_calibration():
    """What SloWatch.close does with a decision's prediction: observed TTFT (from the routing call)
    and TPOT, each beside the mean predicted, into the served model's calibration."""
    model = f"model-{uuid.uuid4().hex[:6]}"
    watch = SloWatch(Objectives(ttft_ms=1000), model, "tenant", "standard", arrival=10.0, choices=1)
    watch.routing(10.1)
    watch.prediction = LatencyPrediction(200.0, 30.0, 150.0, 20.0)
    watch.first_token(0, 10.4)
    watch.ended(0, 10.7, tokens=11)
    watch.close()
    fed = calibration(model)
    assert fed.observed("ttft") == 1 and fed.observed("tpot") == 1
    assert list(fed._scores["ttft"].pairs) == [(0.15, 10.4 - 10.1)]
    assert list(fed._scores["tpot"].pairs)[0][0] == 0.02
    missed = SloWatch(Objectives(ttft_ms=1000), model, "tenant", "standard", arrival=10.0, choices=1)
    missed.routing(10.1)  # routed with a calibrated TTFT p90 of 200 ms, observed 300: a miss raises the level
    missed.prediction = LatencyPrediction(200.0, 30.0, 150.0, 20.0, ttft_calibrated=True)
    missed.ended(0, 10.4, tokens=1)
    missed.close()
    assert fed.level("ttft") > 0.9 and fed.level("tpot") == 0.9 and fed.observed("ttft") == 2
    older = SloWatch(Objectives(ttft_ms=1000), model, "tenant", "standard", arrival=10.0, choices=1)
    older.routing(10.1)
    older.prediction = LatencyPrediction(200.0, 30.0)  # no mean (a router of an older revision): not fed
    older.ended(0, 10.4, tokens=1)
    older.close()
    assert fed.observed("ttft") == 2
