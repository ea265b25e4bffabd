"""Routing by headroom: the `slo` policy, which the default (and `affinity`) runs for every request
that carries latency objectives (router/protocol/slo.py; x-slo-ttft-ms, x-slo-tpot-ms).

Among the scored replicas predicted to meet both objectives (router/latency_model.py: the p90
TTFT and TPOT the request would see there), today's policy chooses as it always does (prefix,
session, load and pull costs, every replica priced, so a pull from a busy holder stays on
offer); a replica with no prediction yet (cold: new, restarted) counts as meeting them, so it
gets traffic to learn from. When none is predicted to meet them, the replica of least violation
wins (the largest of predicted / objective - 1 over the two objectives; ties by today's cost).
With no prediction anywhere (no step model warm, heartbeats stale, Redis away) it decides
exactly as today's policy. A request without objectives is today's policy's, untouched.

The p90 is the step model's until the gateway has observed enough of the model's requests, then
the step model's mean with an end-to-end conformal bound on those observations
(router/latency_calibration.py). The decision names this policy (`slo`) and carries the chosen
replica's prediction, p90 and mean, which the gateway compares with what it observes
(prefixgate_slo_prediction_*) and feeds back. Its reason is `slo` where
the objectives changed the choice (today's policy would have sent the request to a replica
predicted to miss) or none could meet them; otherwise today's reason (prefix, session, load, pull).
"""

from __future__ import annotations

import dataclasses

from msgspec.structs import replace

from router.latency_calibration import Calibration
from router.latency_model import Prediction, predict
from router.policy import AffinityPolicy, Policy, ReplicaView, RouteRequest
from router.protocol.messages import RouteDecision
from router.protocol.redis_schema import queued_ahead
from router.protocol.slo import LatencyPrediction, Objectives


def violation(p: Prediction, objectives: Objectives) -> float:
    """How far a prediction misses its objectives: the largest predicted / objective - 1 (<= 0:
    it meets them)."""
    worst = -1.0
    if objectives.ttft_ms is not None:
        worst = max(worst, p.ttft_s * 1000 / objectives.ttft_ms - 1)
    if objectives.tpot_ms is not None:
        worst = max(worst, p.tpot_s * 1000 / objectives.tpot_ms - 1)
    return worst


def prediction_of(request: RouteRequest, v: ReplicaView, calibration: Calibration | None = None) -> Prediction | None:
    """The request's p90 TTFT and TPOT on `v`, recalibrated on the gateway's observations where
    `calibration` has enough of them; None without a warm step model there."""
    if v.step_fit is None:
        return None
    uncached = max(request.num_prompt_tokens - v.matched_blocks * request.block_size, 0)
    ahead = queued_ahead({"waiting": v.waiting, "pending_prefill_tokens": v.pending_prefill_tokens,
                          "queued_by_priority": v.queued_by_priority}, request.priority)
    p = predict(v.step_fit, uncached=uncached, prompt_tokens=request.num_prompt_tokens, running=v.running,
                waiting=v.waiting, pending_prefill=v.pending_prefill_tokens, context=v.context_tokens, ahead=ahead)
    if calibration is None:
        return p
    return dataclasses.replace(p, ttft_s=calibration.p90("ttft", p.ttft_mean_s, p.ttft_s),
                               tpot_s=calibration.p90("tpot", p.tpot_mean_s, p.tpot_s))


class SloPolicy(Policy):
    """Today's policy (`base`, an affinity policy) for requests without objectives; routing by
    headroom for those with them."""

    name = "slo"

    def __init__(self, base: AffinityPolicy, calibration: Calibration | None = None) -> None:
        self.base = base
        self.calibration = calibration  # the gateway's observations of this model (None: the step model's p90)
        self.rng = base.rng
        self.needs_all_replicas = base.needs_all_replicas

    def decide(self, request: RouteRequest, replicas: list[ReplicaView], session_replica: str | None = None) -> RouteDecision:
        objectives = request.objectives
        if objectives is None or not objectives.any:
            return self.base.decide(request, replicas, session_replica)
        predicted = {v.replica_id: prediction_of(request, v, self.calibration) for v in replicas}
        if all(p is None for p in predicted.values()):
            return self.base.decide(request, replicas, session_replica)  # cold everywhere: today's
        misses = {rid: violation(p, objectives) for rid, p in predicted.items() if p is not None}
        meeting = {v.replica_id for v in replicas if misses.get(v.replica_id, 0.0) <= 0}
        if len(meeting) == len(replicas):
            decision = self.base.decide(request, replicas, session_replica)
        elif meeting:
            state = self.rng.getstate()  # what today's policy would choose, without effects
            alone = self.base.decide(request, replicas, session_replica)
            self.rng.setstate(state)
            decision = self.base.decide_among(request, replicas, session_replica, meeting)
            if decision.replica_id != alone.replica_id:
                decision = replace(decision, reason="slo")
        else:
            costs = self.base.costs(request, replicas)
            best = self._argmin(replicas, lambda v: (misses[v.replica_id], costs[v.replica_id]))
            decision = self.base.decide_among(request, replicas, None, {best.replica_id})
            decision = replace(decision, reason="slo")
        p = predicted[decision.replica_id]
        c = self.calibration
        seen = LatencyPrediction(p.ttft_s * 1000, p.tpot_s * 1000, p.ttft_mean_s * 1000, p.tpot_mean_s * 1000,
                                 c is not None and c.ready("ttft"), c is not None and c.ready("tpot")) if p is not None else None
        return replace(decision, policy=self.name, prediction=seen)

    # everything else is today's policy's
    def commit(self, request, replica_id, matched_blocks, fleet_size):
        self.base.commit(request, replica_id, matched_blocks, fleet_size)

    def cost(self, request, v):
        return self.base.cost(request, v)

    def costs(self, request, replicas):
        return self.base.costs(request, replicas)

    def rank(self, request, replicas):
        return self.base.rank(request, replicas)

    def calibrate(self, **rates: float | None) -> None:
        self.base.calibrate(**rates)


def with_objectives(policy: Policy, calibration: Calibration | None = None) -> Policy:
    """`policy` routing requests with objectives by headroom: the affinity policies (the default
    among them) wrapped in SloPolicy; any other (the cache-blind and hashing baselines) as it is."""
    return SloPolicy(policy, calibration) if isinstance(policy, AffinityPolicy) else policy
