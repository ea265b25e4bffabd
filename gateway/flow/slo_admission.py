"""Admission by latency objective: whether a request with a TTFT objective can still meet it on
any replica, asked once per request, as the gateway is about to send it; and its 429 when not.

The prediction is the gateway's own, made from the heartbeats its flow controller already reads
(saturation.py HeartbeatReader: no round trip of its own): each replica's step model
(router/latency_model.py, the router's, fitted on the same heartbeats) and its load give the
mean TTFT (the p90 less its residual quantiles) of a request there whose prompt is all cached, the work ahead of it alone (pending
prefill, waiting requests, the decode batch it would join). The gateway does not look the
prompt up in the prefix index (the router's round trip, made once the request is sent), so this
is a lower bound of what the router predicts for the same request on the same heartbeats: the
floor over the replicas, computed once per heartbeat read, so that asking costs a comparison.
A request whose time already spent at the gateway plus that floor exceeds its objective cannot
meet it anywhere. No prediction (any replica cold or restarted, heartbeats stale, Redis away):
admitted as before objectives existed.

What is done with one that cannot: `default` and `flex` requests are shed (429 with a
Retry-After from the prediction: when the work ahead of it now will have drained to within its
objective); a `priority` request is never shed for its objective: it is queued and sent as
any other. A queued `default` or `flex` request whose deadline (arrival + objective) passed
while it waited is shed too (`expired`). TPOT objectives route (router/slo_policy.py) but shed
nothing: the batch a request joins is the replica's to size.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gateway.errors import APIError
from gateway.flow.tiers import RANK
from router.latency_model import LatencyModels, predict
from router.protocol.redis_schema import queued_ahead

SHEDDABLE = ("default", "flex")  # the tiers shed for an objective they cannot meet (priority waits)
SHEDDABLE_RANKS = tuple(RANK[t] for t in SHEDDABLE)
REASONS = ("predicted", "expired")
RETRY_AFTER_MAX_S = 60
MAX_AGE_S = 3.0  # a floor not refreshed for this long (Redis away) is no prediction


def ttft_floor_s(models: LatencyModels, loads: Mapping[str, Mapping[str, int | str]],
                 priority: int | None = None) -> float | None:
    """The least mean predicted TTFT over the replicas for a fully cached prompt (seconds) of scheduling
    `priority` (it waits only for the work of its priority and better there: redis_schema's
    queued_ahead; None: for all of it); None when there is no replica or any is cold (a cold
    replica may meet anything: it is not ruled out). The mean, not the p90 the router routes by:
    a request is shed when it is expected to miss, not when it might (a request whose p90 is over
    its objective may still meet it most of the time: shedding on the p90 refused requests that
    would have met theirs)."""
    best = None
    for rid, load in loads.items():
        fit = models.fit(rid)
        if fit is None:
            return None
        ahead = queued_ahead(load, priority) if priority is not None else None
        p = predict(fit, uncached=0, prompt_tokens=0, running=int(load.get("running", 0)),
                    waiting=int(load.get("waiting", 0)), pending_prefill=int(load.get("pending_prefill_tokens", 0)),
                    context=int(load.get("context_tokens", 0)), ahead=ahead, quantile=False)
        best = p.ttft_s if best is None else min(best, p.ttft_s)
    return best


class TtftFloor:
    """One model's step models and TTFT floor, fed by its HeartbeatReader (`observe`, after each
    read). Memory: LatencyModels' (6 KiB a replica); cost: one fit per replica every REFIT_S,
    and a prediction per replica per read and per scheduling priority asked for (six at most:
    tiers.replica_priority), none per request."""

    def __init__(self, max_age_s: float = MAX_AGE_S, models: LatencyModels | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.models = models or LatencyModels()
        self.max_age_s, self.clock = max_age_s, clock
        self._loads: Mapping[str, Mapping[str, int | str]] = {}
        self._floors: dict[int | None, float | None] = {}  # priority -> floor, for the last read
        self._at = -math.inf

    def observe(self, loads: Mapping[str, Mapping[str, int | str]], now: float) -> None:
        self.models.observe(loads, now)
        self.models.refit(now)
        self._loads, self._floors = loads, {}
        self._at = now

    def best_ttft_s(self, priority: int | None = None) -> float | None:
        """The floor as last read for a request of scheduling `priority` (None: behind all the
        work); None when cold or stale."""
        if self.clock() - self._at > self.max_age_s:
            return None
        if priority not in self._floors:
            self._floors[priority] = ttft_floor_s(self.models, self._loads, priority)
        return self._floors[priority]


@dataclass(frozen=True)
class Shed:
    """Why a request is shed for its objective, and what its 429 says."""

    reason: str  # predicted | expired
    ttft_ms: int
    waited_s: float
    predicted_s: float | None = None

    @property
    def retry_after_s(self) -> int:
        """Predicted: when the work ahead of it now will have drained to within its objective."""
        wait = 1.0 if self.predicted_s is None else self.predicted_s - self.ttft_ms / 1000
        return max(1, min(RETRY_AFTER_MAX_S, math.ceil(wait)))


def predicted_shed(tier: str, ttft_ms: int | None, waited_s: float, predicted_s: float | None) -> Shed | None:
    """The shed of a request about to be sent, or None to send it: it has a TTFT objective, its
    tier may be shed, there is a prediction, and the time it has spent plus the best predicted
    TTFT exceed the objective."""
    if ttft_ms is None or tier not in SHEDDABLE or predicted_s is None:
        return None
    if waited_s + predicted_s <= ttft_ms / 1000:
        return None
    return Shed("predicted", ttft_ms, waited_s, predicted_s)


def refusal(shed: Shed, tier: str, retry_after_s: int | None = None) -> APIError:
    """The 429, OpenAI-shaped, saying why; `retry_after_s` for an expired one (the queue's)."""
    if shed.reason == "predicted":
        retry = shed.retry_after_s
        why = (f"no replica is predicted to start it within its time-to-first-token objective of {shed.ttft_ms} ms: "
               f"the best predicted time is {shed.predicted_s * 1000:.0f} ms, after {shed.waited_s * 1000:.0f} ms "
               "at the gateway")
    else:
        retry = retry_after_s or 1
        why = (f"it waited {shed.waited_s * 1000:.0f} ms in the queue, past its time-to-first-token objective "
               f"of {shed.ttft_ms} ms")
    message = (f"Request shed ({tier} tier): {why}. Retry in {retry} s, or ask with a longer x-slo-ttft-ms, "
               "or with service_tier=priority (queued, never shed for its objective).")
    return APIError(429, message, "rate_limit_error", code="slo_unattainable", headers={"Retry-After": str(retry)})
