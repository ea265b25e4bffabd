"""Each replica's latency, learned from its own steps: the p90 TTFT and TPOT a request would see there.

A step's time is modelled as linear in what it computes,

    step_s = c0 + c1 * prefill_tokens + c2 * decode_rows + c3 * context_tokens + c4 * requests_started

fitted with numpy's least squares on the replica's recent steps. The heartbeat carries its steps
as cumulative totals (router/protocol/redis_schema.py Heartbeat step_*; replica/core/step_timings.py),
so each new read of a replica's heartbeat gives one sample: the mean step of the interval since
the previous read (a missed read only makes the interval longer). The samples of the last
`capacity` intervals are kept in a ring buffer per replica; every `refit_s` the model is fitted
on the older two thirds and its residuals measured on the newest third (split-conformal): their
p90 (the finite-sample rank) is added to a prediction, so about 90% of the interval means of
the calibration samples lie under it. A cost that fits negative (too little variation in that
feature yet) is dropped and the rest refitted: a step never gets cheaper with more work.

From the fit, for a request on a replica (`predict`):

* TTFT: the work ahead of it there: the pending prefill tokens of its priority and better (the
  heartbeat's queued_by_priority; the replica's scheduler serves lower priority values first),
  plus its own uncached ones, cut
  in chunks of the step budget less the decode rows (running and waiting requests decode
  beside them), n steps each paying the decode batch and its context, plus each waiting
  request's start and its own. p90: the mean plus n residual quantiles (the error of n steps
  is about n times the mean error of an interval of similar length).
* TPOT: one step of the batch it would join: every running and waiting request and itself,
  their context plus its prompt, and the prefill the replica's recent steps carried. p90: plus
  one residual quantile.

Cold (fewer than `min_samples` samples: a new or restarted replica, whose totals went down),
or with no fresh heartbeat (the load table's, stale when Redis is away), there is no
prediction and the caller routes on today's costs.

Memory: `capacity` x 6 float64 per replica (128: 6 KiB; 64 replicas: under 0.5 MiB per router).
A fit is one lstsq of `capacity` x 5 (tens of microseconds), run in the load table's refresh,
never in a decision; a prediction is a few float operations.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

QUANTILE = 0.9
CAPACITY = 128  # samples (heartbeat intervals) kept per replica: about a minute at two a second
MIN_SAMPLES = 12  # fewer: cold, no prediction (a few seconds of a busy replica's heartbeats)
REFIT_S = 2.0  # each replica's model is refitted this often while it has new samples
FORGET_S = 120.0  # a replica whose heartbeat has not been seen for this long is forgotten
FITS_PER_REFRESH = 8  # at most this many fits per load-table refresh (they never pile up in one)
_TOTALS = ("step_count", "step_us", "step_prefill_tokens", "step_rows", "step_context_tokens", "step_started")
# sample columns: the mean step's prefill tokens, rows, context tokens, requests started; its seconds; steps
_PREFILL, _ROWS, _CONTEXT, _STARTED, _SECONDS, _STEPS = range(6)


@dataclass(frozen=True)
class StepFit:
    """One replica's fitted step model: costs in seconds (base, per prefill token, per decode
    row, per context token, per request started), the residual p90 of a mean step, and what its
    recent steps carried."""

    coef: tuple[float, float, float, float, float]
    q: float
    prefill_per_step: float  # recent mean prefill tokens per step
    started_per_step: float  # recent mean requests started per step
    budget: int  # the most tokens one step schedules (0: unknown)
    samples: int

    def step_s(self, prefill: float, rows: float, context: float, started: float) -> float:
        c = self.coef
        return c[0] + c[1] * prefill + c[2] * rows + c[3] * context + c[4] * started


@dataclass(frozen=True)
class Prediction:
    """p90 seconds to the first token and per output token after it, and the means they bound
    (what router/latency_calibration.py recalibrates the p90 from)."""

    ttft_s: float
    tpot_s: float
    ttft_mean_s: float = 0.0
    tpot_mean_s: float = 0.0


def predict(fit: StepFit, *, uncached: int, prompt_tokens: int, running: int, waiting: int,
            pending_prefill: int, context: int, ahead: tuple[int, int] | None = None,
            quantile: bool = True) -> Prediction:
    """The request's p90 TTFT and TPOT on a replica whose step model is `fit` and whose load is
    the rest (its heartbeat's, as the router's view has it). `ahead`: (requests waiting, prompt
    tokens not computed) that the request waits for at its priority (redis_schema.queued_ahead;
    None: all of it); the batch it joins is everyone's. quantile False: the mean, without the
    residual quantiles (what is expected, not what is likely not exceeded)."""
    q = fit.q if quantile else 0.0
    rows = running + waiting
    waiting_ahead, pending_ahead = ahead if ahead is not None else (waiting, pending_prefill)
    work = pending_ahead + uncached
    chunk = max(fit.budget - rows, 1) if fit.budget else max(fit.prefill_per_step, 1.0)
    steps = max(math.ceil(work / chunk), 1)
    beside = fit.coef[0] + fit.coef[2] * rows + fit.coef[3] * context  # what every step pays besides prefill
    ttft_mean = steps * beside + fit.coef[1] * work + fit.coef[4] * (waiting_ahead + 1)
    joined = rows + 1
    prefill = min(fit.prefill_per_step, max(fit.budget - joined, 0)) if fit.budget else fit.prefill_per_step
    tpot_mean = fit.step_s(prefill, joined, context + pending_prefill + prompt_tokens, fit.started_per_step)
    ttft_mean, tpot_mean = max(ttft_mean, 0.0), max(tpot_mean, 0.0)
    return Prediction(max(ttft_mean + steps * q, 0.0), max(tpot_mean + q, 0.0), ttft_mean, tpot_mean)


def fit_steps(samples: np.ndarray, budget: int) -> StepFit | None:
    """Split-conformal fit of `samples` (rows of the sample columns, oldest first); None with
    fewer than MIN_SAMPLES."""
    n = len(samples)
    if n < MIN_SAMPLES:
        return None
    x = np.column_stack([np.ones(n), samples[:, _PREFILL], samples[:, _ROWS], samples[:, _CONTEXT], samples[:, _STARTED]])
    y = samples[:, _SECONDS]
    w = np.sqrt(samples[:, _STEPS])  # an interval of more steps is a steadier mean
    calibration = max(n // 3, 4)
    train = slice(0, n - calibration)
    coef = _nonnegative_lstsq(x[train], y[train], w[train])
    residuals = y[n - calibration:] - x[n - calibration:] @ coef
    rank = math.ceil((calibration + 1) * QUANTILE)  # split-conformal: the finite-sample rank
    q = float(np.sort(residuals)[min(rank, calibration) - 1])
    recent = samples[-min(n, 8):]
    return StepFit(tuple(float(c) for c in coef), max(q, 0.0), float(recent[:, _PREFILL].mean()),
                   float(recent[:, _STARTED].mean()), budget, n)


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least squares (numpy's lstsq on scaled columns), refitted without the features
    whose cost came out negative: at most one refit per feature."""
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
    keep = np.ones(x.shape[1], dtype=bool)
    coef = np.zeros(x.shape[1])
    for _ in range(x.shape[1]):
        sol = np.linalg.lstsq((x[:, keep] / scale[keep]) * w[:, None], y * w, rcond=None)[0] / scale[keep]
        coef[:] = 0.0
        coef[keep] = sol
        negative = keep & (coef < 0)
        if not negative.any():
            break
        keep &= ~negative
        if not keep.any():
            break
    return coef


class _Replica:
    """One replica's ring buffer of samples, its last totals and its current fit."""

    def __init__(self, capacity: int) -> None:
        self.buffer = np.zeros((capacity, 6))
        self.size = 0
        self.next = 0
        self.totals: tuple[int, ...] | None = None
        self.fit: StepFit | None = None
        self.fitted_at = -math.inf
        self.new = 0  # samples since the last fit
        self.seen_at = 0.0
        self.budget = 0

    def reset(self) -> None:
        self.size = self.next = self.new = 0
        self.fit = None

    def add(self, totals: tuple[int, ...]) -> None:
        last, self.totals = self.totals, totals
        if last is None:
            return
        delta = [a - b for a, b in zip(totals, last, strict=True)]
        if any(d < 0 for d in delta):  # the totals went down: the replica restarted, relearn it
            self.reset()
            return
        steps = delta[0]
        if steps <= 0:
            return
        row = self.buffer[self.next]
        row[_PREFILL], row[_ROWS], row[_CONTEXT], row[_STARTED] = (d / steps for d in delta[2:])
        row[_SECONDS], row[_STEPS] = delta[1] / steps / 1e6, steps
        self.next = (self.next + 1) % len(self.buffer)
        self.size = min(self.size + 1, len(self.buffer))
        self.new += 1

    def samples(self) -> np.ndarray:
        """Oldest first."""
        if self.size < len(self.buffer):
            return self.buffer[: self.size]
        return np.roll(self.buffer, -self.next, axis=0)


class LatencyModels:
    """Every watched replica's step model, fed by the load table with each heartbeat read
    (`observe`) and refitted there (`refit`), read by decisions (`fit`). `clock` is the load
    table's (seconds)."""

    def __init__(self, capacity: int = CAPACITY, refit_s: float = REFIT_S) -> None:
        self.capacity = capacity
        self.refit_s = refit_s
        self._replicas: dict[str, _Replica] = {}
        self.fits = 0  # fits made (tests wait on it)

    def observe(self, loads: Mapping[str, Mapping[str, int | str]], now: float) -> None:
        """One read of the heartbeats: a sample per replica whose steps advanced."""
        replicas = self._replicas
        for rid, hb in loads.items():
            state = replicas.get(rid)
            if state is None:
                state = replicas[rid] = _Replica(self.capacity)
            state.seen_at = now
            if state.totals is not None and hb.get("step_count", 0) == state.totals[0]:
                continue  # no step since the last read (idle): nothing to learn, nothing to build
            state.budget = int(hb.get("step_token_budget", 0) or 0)
            state.add(tuple(int(hb.get(k, 0) or 0) for k in _TOTALS))
        if len(replicas) > len(loads):
            for rid in [r for r, s in replicas.items() if now - s.seen_at > FORGET_S]:
                del replicas[rid]

    def refit(self, now: float, limit: int = FITS_PER_REFRESH) -> int:
        """Refit the replicas with new samples whose fit is older than refit_s, the stalest
        first, at most `limit`; returns how many."""
        due = [s for s in self._replicas.values() if s.new and now - s.fitted_at >= self.refit_s]
        due.sort(key=lambda s: s.fitted_at)
        for state in due[:limit]:
            state.fit = fit_steps(state.samples(), state.budget)
            state.fitted_at, state.new = now, 0
            self.fits += 1
        return min(len(due), limit)

    def fit(self, replica_id: str) -> StepFit | None:
        """The replica's current fit; None when cold (or unknown)."""
        state = self._replicas.get(replica_id)
        return state.fit if state is not None else None
