"""Whether a request with latency objectives met them, measured on the gateway's clock.

The replicas' stream chunks carry no timings (router/protocol/messages.py: an EndChunk holds token
counts only), so the gateway times what it receives, streamed or not alike (a non-streamed
request is read from the same chunks): TTFT from the request's arrival at the gateway to its
first token chunk (routing and queueing included, as `prefixgate_time_to_first_token_seconds`),
TPOT as (end - first token) / (output tokens - 1). A replica sends the first chunk and the last
at once (STREAM_INTERVAL_S batches only those between), so both ends are timed as they happen.
With `n` choices the request is as late as its latest choice.

A request is judged once: when every choice ended, by its timings; when it was refused or
failed after reaching the queue (429, 5xx), as having met nothing. A client that left before
the end leaves no verdict (nothing says what it would have seen).

Where the router decided with a latency model (router/slo_policy.py), its decision carries the
p90 TTFT and TPOT it predicted on the chosen replica (`LatencyPrediction`, back in the stream's
StartChunk); the judged request's observed TTFT, timed from the routing call (the gateway's
queue is not the replica's to predict), and TPOT are held against it: the
prefixgate_slo_prediction_* metrics, the model's coverage and error. The same observations,
beside the mean the router predicted, recalibrate the router's p90 for the model's next
requests (router/latency_calibration.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway import metrics as m
from gateway.flow.slo import Objectives
from router.latency_calibration import calibration
from router.protocol.slo import LatencyPrediction


@dataclass(frozen=True)
class Verdict:
    """One request's observed latencies and, per objective it had, whether it met it (None: it
    had none; a TPOT objective of a request that never produced two tokens is met)."""

    ttft_s: float | None
    tpot_s: float | None
    ttft_met: bool | None
    tpot_met: bool | None

    @property
    def good(self) -> bool:
        """Met every objective it had (goodput counts it)."""
        return self.ttft_met is not False and self.tpot_met is not False


def judge(objectives: Objectives, ttft_s: float | None, tpot_s: float | None) -> Verdict:
    """The verdict of observed latencies (seconds) against objectives (ms); None observed means a
    failed request for TTFT and no inter-token interval for TPOT."""
    ttft_met = None if objectives.ttft_ms is None else ttft_s is not None and ttft_s * 1000 <= objectives.ttft_ms
    tpot_met = None if objectives.tpot_ms is None else tpot_s is None or tpot_s * 1000 <= objectives.tpot_ms
    return Verdict(ttft_s, tpot_s, ttft_met, tpot_met)


def tpot_s(first_at: float, end_at: float, tokens: int) -> float | None:
    """Time per output token after the first; None with fewer than two tokens."""
    return (end_at - first_at) / (tokens - 1) if tokens >= 2 else None


def record(verdict: Verdict | None, objectives: Objectives, model: str, tenant: str, tier: str) -> None:
    """The verdict into the prefixgate_slo_* metrics; None: a request refused or failed, which had
    its objectives and met none."""
    had = {"ttft": objectives.ttft_ms is not None, "tpot": objectives.tpot_ms is not None}
    had["both"] = had["ttft"] and had["tpot"]
    met = {"ttft": False, "tpot": False}
    if verdict is not None:
        met = {"ttft": verdict.ttft_met is True, "tpot": verdict.tpot_met is True}
    met["both"] = had["both"] and met["ttft"] and met["tpot"]
    m.SLO_REQUESTS.labels(model, tenant, tier).inc()
    for objective in m.SLO_OBJECTIVES:
        if had[objective]:
            m.SLO_HAD.labels(model, tenant, tier, objective).inc()
        if met[objective]:
            m.SLO_MET.labels(model, tenant, tier, objective).inc()
    if verdict is None:
        return
    if verdict.good:
        m.SLO_GOODPUT.labels(model, tenant, tier).inc()
    for objective, seen, goal in (("ttft", verdict.ttft_s, objectives.ttft_ms), ("tpot", verdict.tpot_s, objectives.tpot_ms)):
        if seen is not None and goal is not None:
            m.SLO_RATIO.labels(model, tier, objective).observe(seen * 1000 / goal)


def record_prediction(prediction: LatencyPrediction, ttft_s: float | None, tpot_s: float | None, model: str) -> None:
    """Observed latencies (seconds; None: not observed) against the router's p90 (ms), and fed
    back, beside its mean, to the calibration the router's next p90s come from."""
    fed = calibration(model)
    for objective, seen, predicted, mean, calibrated in (
            ("ttft", ttft_s, prediction.ttft_ms, prediction.ttft_mean_ms, prediction.ttft_calibrated),
            ("tpot", tpot_s, prediction.tpot_ms, prediction.tpot_mean_ms, prediction.tpot_calibrated)):
        if seen is None:
            continue
        if mean > 0:
            fed.observe(objective, mean / 1000, seen, seen * 1000 <= predicted if calibrated else None)
        m.SLO_PREDICTIONS.labels(model, objective).inc()
        if seen * 1000 <= predicted:
            m.SLO_COVERED.labels(model, objective).inc()
        if predicted > 0:
            m.SLO_PREDICTION_RATIO.labels(model, objective).observe(seen * 1000 / predicted)


class SloWatch:
    """One request's timings as the gateway receives its choices (RequestRun feeds it), judged once."""

    def __init__(self, objectives: Objectives, model: str, tenant: str, tier: str, arrival: float, choices: int) -> None:
        self.objectives, self.model, self.tenant, self.tier, self.arrival = objectives, model, tenant, tier, arrival
        self.first_at: list[float | None] = [None] * choices
        self.end_at: list[float | None] = [None] * choices
        self.tokens = [0] * choices
        self.verdict: Verdict | None = None
        self.judged = False
        self.routed_at: float | None = None  # when its streams were first read: the routing call
        self.prediction: LatencyPrediction | None = None  # the router's, for the replica that took it

    def routing(self, at: float) -> None:
        if self.routed_at is None:
            self.routed_at = at

    def first_token(self, index: int, at: float) -> None:
        if self.first_at[index] is None:
            self.first_at[index] = at

    def ended(self, index: int, at: float, tokens: int) -> None:
        """A choice's end (the first report wins: an end read with the first token is timed then)."""
        if self.end_at[index] is None:
            self.end_at[index], self.tokens[index] = at, tokens
            self.first_token(index, at)

    def failed(self, status: int) -> None:
        """Refused or failed after reaching the queue: a 429 or a 5xx met nothing; any other error
        (the request's own fault) is not judged."""
        if self.judged:
            return
        self.judged = True
        if status == 429 or status >= 500:
            record(None, self.objectives, self.model, self.tenant, self.tier)

    def close(self) -> None:
        """The request is over: judge it by its timings if every choice ended."""
        if self.judged:
            return
        self.judged = True
        if any(t is None for t in self.end_at):
            return  # its client left first: no verdict
        ttft = max(t for t in self.first_at if t is not None) - self.arrival
        per_token = [tpot_s(f, e, n) for f, e, n in zip(self.first_at, self.end_at, self.tokens, strict=True)
                     if f is not None and e is not None]
        tpots = [t for t in per_token if t is not None]
        self.verdict = judge(self.objectives, ttft, max(tpots) if tpots else None)
        record(self.verdict, self.objectives, self.model, self.tenant, self.tier)
        if self.prediction is not None and self.routed_at is not None:
            first = max(t for t in self.first_at if t is not None)
            record_prediction(self.prediction, first - self.routed_at, self.verdict.tpot_s, self.model)
