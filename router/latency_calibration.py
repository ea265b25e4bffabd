"""The latency model's p90 recalibrated on what the gateway observed end to end.

The step model (router/latency_model.py) predicts a request's time in steps: its p90 is a
conformal bound on a *step's* error. What a client sees also holds what no step carries (the
hops from gateway to replica and back, stream batching, the step in progress when it arrives,
the replica's scheduling choices), so the step model's p90 covered 30-61% of observed TTFTs in
`prefixgate bench goodput`, against an aim of 85-95%.

So the gateway, which times every request with objectives (gateway/slo_watch.py), feeds each
observation back here beside the model's *mean* prediction for it, and the router's p90 becomes
a conformal bound on those end-to-end errors (split-conformal with a normalised score, as in
conformalised regression): over the last WINDOW observations of a model and objective,

    score = (observed - mean) / (mean + scale),   scale = the window's median observed

and the p90 of a new request is `mean + q x (mean + scale)`, q the scores' finite-sample 90%
rank. The scale keeps small predictions (an idle replica's few ms, where the hops dominate)
from turning into huge ratios; coverage holds whatever it is (the scores only rank). Until
MIN_OBSERVED observations, the step model's own p90 stands.

A trailing window lags a load that keeps changing (a rising rate makes every new error larger
than the window's), so the level itself adapts, as adaptive conformal inference does (Gibbs &
Candes, 2021): each observation judged against a calibrated p90 moves the miss rate aimed at,
`alpha += GAMMA x (0.1 - missed)`, so a run of misses raises the rank and a run of covers
lowers it, and over a run the share covered tends to 90% whatever the drift. GAMMA 0.02: 0.05
measured worse over `prefixgate bench goodput`'s runs (docs/benchmarks.md); 0.01, with a start at
32, covered 84.5% / 85.6% on seed 1.

One Calibration per served model per process (`calibration`): the gateway and the router it
runs (Serve runs the request router in the handle's process) share it. Memory: WINDOW x 2 floats
per model and objective; a refit (numpy sort of WINDOW values) every REFIT_EVERY observations,
never in a decision; a decision's p90 is two float operations.
"""

from __future__ import annotations

import math
import threading
from collections import deque

import numpy as np

QUANTILE = 0.9
WINDOW = 256  # observations kept per model and objective: the last minute or two of a busy model
MIN_OBSERVED = 16  # fewer: the step model's own p90
REFIT_EVERY = 8  # the quantile is recomputed after this many new observations
GAMMA = 0.02  # the adaptive level's step per observation judged against a calibrated p90
ALPHA_RANGE = (0.005, 0.5)  # the miss rate aimed at stays within this
OBJECTIVES = ("ttft", "tpot")


class _Scores:
    """One objective's recent (mean predicted, observed) pairs and their fitted quantile."""

    def __init__(self, window: int) -> None:
        self.pairs: deque[tuple[float, float]] = deque(maxlen=window)
        self.fresh = 0  # observations since the last fit
        self.q: float | None = None  # the score quantile (None: too few observations)
        self.scale = 0.0
        self.alpha = 1 - QUANTILE  # the miss rate aimed at (adaptive conformal inference)

    def fit(self, min_observed: int) -> None:
        self.fresh = 0
        n = len(self.pairs)
        if n < min_observed:
            self.q = None
            return
        pairs = np.asarray(self.pairs)
        mean, observed = pairs[:, 0], pairs[:, 1]
        self.scale = float(np.median(observed))
        scores = (observed - mean) / np.maximum(mean + self.scale, 1e-9)
        rank = min(math.ceil((n + 1) * (1 - self.alpha)), n)  # the finite-sample rank of the level aimed at
        self.q = float(np.partition(scores, rank - 1)[rank - 1])


class Calibration:
    """A served model's end-to-end calibration: the gateway `observe`s, the router asks `p90`."""

    def __init__(self, window: int = WINDOW, min_observed: int = MIN_OBSERVED) -> None:
        self.min_observed = min_observed
        self._scores = {objective: _Scores(window) for objective in OBJECTIVES}
        self._lock = threading.Lock()  # the gateway's event loop and the router's may differ

    def observe(self, objective: str, mean_s: float, observed_s: float, covered: bool | None = None) -> None:
        """One request's observed `objective` ("ttft" or "tpot") beside the mean predicted for it;
        `covered`: whether it was within the calibrated p90 it was routed with (None: that p90 was
        the step model's), which adapts the level."""
        if mean_s < 0 or observed_s < 0 or not math.isfinite(mean_s) or not math.isfinite(observed_s):
            return
        scores = self._scores[objective]
        with self._lock:
            if covered is not None:
                low, high = ALPHA_RANGE
                scores.alpha = min(max(scores.alpha + GAMMA * ((1 - QUANTILE) - (not covered)), low), high)
            scores.pairs.append((mean_s, observed_s))
            scores.fresh += 1
            if scores.q is None or scores.fresh >= REFIT_EVERY:
                scores.fit(self.min_observed)

    def observed(self, objective: str) -> int:
        """Observations of `objective` in the window."""
        return len(self._scores[objective].pairs)

    def level(self, objective: str) -> float:
        """The quantile level the p90 is taken at now (0.9 until misses or covers move it)."""
        return 1 - self._scores[objective].alpha

    def ready(self, objective: str) -> bool:
        """Whether `objective`'s p90 comes from the observations (else the step model's)."""
        return self._scores[objective].q is not None

    def p90(self, objective: str, mean_s: float, model_p90_s: float) -> float:
        """The calibrated p90 for a request whose mean prediction is `mean_s`; the step model's
        own (`model_p90_s`) until enough has been observed."""
        scores = self._scores[objective]
        q = scores.q
        if q is None:
            return model_p90_s
        return max(mean_s + q * (mean_s + scores.scale), 0.0)


_CALIBRATIONS: dict[str, Calibration] = {}
_REGISTRY_LOCK = threading.Lock()


def calibration(model: str) -> Calibration:
    """The process's calibration of served model `model`."""
    found = _CALIBRATIONS.get(model)
    if found is None:
        with _REGISTRY_LOCK:
            found = _CALIBRATIONS.setdefault(model, Calibration())
    return found
