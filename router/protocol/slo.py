"""Latency objectives and predictions as they cross processes: the gateway resolves a request's
`Objectives` (gateway/flow/slo.py) and sends them inside its GenerateRequest, so the router in
the gateway's process reads them for its decision and the replica could read them for its
steps; the router's `LatencyPrediction` for the replica it chose travels in the RouteDecision
and back to the gateway in the StartChunk, which compares it with what it observes
(gateway/slo_watch.py). One definition each, checked where they enter a process
(`checked_request`, `decode_chunk`)."""

from __future__ import annotations

import msgspec


class Objectives(msgspec.Struct, frozen=True, omit_defaults=True):
    """A request's objectives in ms (None: no objective of that kind), the one typed form on the
    request path: parsed from the headers, the key's and the tier's defaults alike."""

    ttft_ms: int | None = None
    tpot_ms: int | None = None

    @property
    def any(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def over(self, defaults: Objectives) -> Objectives:
        """These objectives, each one missing here taken from `defaults`."""
        return Objectives(self.ttft_ms if self.ttft_ms is not None else defaults.ttft_ms,
                          self.tpot_ms if self.tpot_ms is not None else defaults.tpot_ms)


class LatencyPrediction(msgspec.Struct, frozen=True):
    """The router's prediction for the request on the replica it chose (router/latency_model.py),
    in ms: the p90 the gateway's coverage metric holds the observed TTFT and TPOT against, and
    the mean the gateway's observations recalibrate that p90 with (router/latency_calibration.py)."""

    ttft_ms: float
    tpot_ms: float
    ttft_mean_ms: float = 0.0
    tpot_mean_ms: float = 0.0
    # each p90 from the gateway's observations (router/latency_calibration.py), not the step model's
    ttft_calibrated: bool = False
    tpot_calibrated: bool = False
