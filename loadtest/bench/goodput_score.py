"""`prefixgate bench goodput`'s arithmetic (pure: no I/O): objectives from the calibration, the
capacity estimate, attainment and goodput of a window, and the summary figures of issue 52's
targets.

Definitions:

- A request's TTFT is its first content event's time after it was sent; its TPOT is (last
  content event - first) / (completion tokens - 1).
- Objectives per class with them (chat, rag): TTFT objective = ttft_x x the class's unloaded
  TTFT p50, TPOT objective = tpot_x x its unloaded TPOT p50 (goodput_mix.CLASSES), whole ms,
  rounded up.
- Capacity (requests/s) = 1 / sum over classes of share_c / X_c, where X_c is class c's
  measured burst throughput: `batch` requests per replica of class c sent at once, their count
  divided by the time from sending them to the last one's end. That is the mix's throughput
  with about `batch` requests running per replica (each class at its own rate, weighted by its
  share), from the unloaded stack; rates are stepped by 10% of it.
- Attainment (per class, and overall over the classes with objectives): the share of the
  window's requests that met the objective; a refused (429) or failed request met none.
  Goodput = requests that met both objectives / window seconds.
- Crossing of a threshold T by a mode's attainment of both (rates ascending): after the highest
  measured rate whose attainment holds T, the next measured rate (under T), interpolated
  linearly between the two (`interpolated`); `not reached` when the highest measured rate holds
  T (the figure is then that rate, a lower bound); `below at every rate` when none does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import pairwise

from loadtest.bench.goodput_mix import BY_NAME, CLASSES
from loadtest.summary import percentile


@dataclass
class Outcome:
    """What one request got."""

    cls: str
    ttft_s: float | None = None
    tpot_s: float | None = None
    tokens: int = 0
    refused: str | None = None  # a 429's error code
    failed: str | None = None  # anything else that was not a complete stream


@dataclass
class ClassCalibration:
    ttft_p50_ms: float
    tpot_p50_ms: float
    burst_rps: float  # requests/s of the class's burst
    n: int  # requests measured one at a time


def objectives(calibration: dict[str, ClassCalibration]) -> dict[str, dict[str, int]]:
    """Class -> {"ttft_ms", "tpot_ms"}, for the classes with objectives."""
    out = {}
    for c in CLASSES:
        if c.has_objectives:
            cal = calibration[c.name]
            out[c.name] = {"ttft_ms": max(1, math.ceil(c.ttft_x * cal.ttft_p50_ms)),
                           "tpot_ms": max(1, math.ceil(c.tpot_x * cal.tpot_p50_ms))}
    return out


def capacity(calibration: dict[str, ClassCalibration]) -> float:
    """The mix's throughput from each class's burst throughput (the module's docstring)."""
    return 1.0 / sum(c.share / calibration[c.name].burst_rps for c in CLASSES)


def _met(o: Outcome, ttft_ms: int, tpot_ms: int) -> tuple[bool, bool]:
    if o.refused or o.failed or o.ttft_s is None or o.tpot_s is None:
        return False, False
    return o.ttft_s * 1000 <= ttft_ms, o.tpot_s * 1000 <= tpot_ms


@dataclass
class ClassResult:
    requests: int = 0
    ttft_met: int = 0
    tpot_met: int = 0
    both_met: int = 0
    refused: int = 0
    failed: int = 0
    refusals: dict[str, int] = field(default_factory=dict)  # by error code (slo_unattainable, server_overloaded, ...)
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    judged: bool = True  # False: a class without objectives (its attainments are None)

    def share(self, n: int) -> float | None:
        return n / self.requests if self.requests and self.judged else None

    @property
    def ttft_attainment(self) -> float | None:
        return self.share(self.ttft_met)

    @property
    def tpot_attainment(self) -> float | None:
        return self.share(self.tpot_met)

    @property
    def attainment(self) -> float | None:
        return self.share(self.both_met)


def _class_result(outs: list[Outcome], obj: dict[str, int] | None, judged: bool | None = None) -> ClassResult:
    r = ClassResult(requests=len(outs), judged=obj is not None if judged is None else judged)
    done = [o for o in outs if not (o.refused or o.failed) and o.ttft_s is not None]
    for o in outs:
        r.refused += bool(o.refused)
        if o.refused:
            r.refusals[o.refused] = r.refusals.get(o.refused, 0) + 1
        r.failed += bool(o.failed)
        if obj is not None:
            ttft, tpot = _met(o, obj["ttft_ms"], obj["tpot_ms"])
            r.ttft_met += ttft
            r.tpot_met += tpot
            r.both_met += ttft and tpot
    ttfts = [o.ttft_s * 1000 for o in done]
    r.ttft_p50_ms, r.ttft_p99_ms = percentile(ttfts, 50), percentile(ttfts, 99)
    r.tpot_p50_ms = percentile([o.tpot_s * 1000 for o in done if o.tpot_s is not None], 50)
    return r


@dataclass
class StepResult:
    """One mode at one offered rate."""

    rate: float  # offered, requests/s
    window_s: float
    sent: int
    classes: dict[str, ClassResult] = field(default_factory=dict)
    overall: ClassResult = field(default_factory=ClassResult)  # the classes with objectives
    # the router's p90 coverage per objective in the step (gateway metrics; requests with objectives only)
    coverage: dict[str, float | None] = field(default_factory=dict)

    @property
    def goodput(self) -> float:
        return self.overall.both_met / self.window_s

    @property
    def attainment(self) -> float | None:
        return self.overall.attainment

    def as_dict(self) -> dict:
        def one(r: ClassResult) -> dict:
            return {**r.__dict__, "ttft_attainment": r.ttft_attainment, "tpot_attainment": r.tpot_attainment,
                    "attainment": r.attainment}
        return {"rate": self.rate, "window_s": self.window_s, "sent": self.sent, "goodput": self.goodput,
                "coverage": self.coverage,
                "overall": one(self.overall), "classes": {k: one(v) for k, v in self.classes.items()}}


def score(outcomes: list[Outcome], objs: dict[str, dict[str, int]], rate: float, window_s: float) -> StepResult:
    out = StepResult(rate=rate, window_s=window_s, sent=len(outcomes))
    for c in CLASSES:
        out.classes[c.name] = _class_result([o for o in outcomes if o.cls == c.name], objs.get(c.name))
    # the classes with objectives together: their counts, and percentiles over all their requests
    out.overall = _class_result([o for o in outcomes if BY_NAME[o.cls].has_objectives], None, judged=True)
    with_obj = [out.classes[c.name] for c in CLASSES if c.has_objectives]
    for name in ("ttft_met", "tpot_met", "both_met"):
        setattr(out.overall, name, sum(getattr(r, name) for r in with_obj))
    return out


@dataclass(frozen=True)
class Crossing:
    rate: float | None
    how: str  # "interpolated", "not reached" (rate: the highest measured, a lower bound), "below at every rate"


def crossing(points: list[tuple[float, float]], threshold: float) -> Crossing:
    """Where attainment (rate, attainment; any order) last falls under `threshold`: after the
    highest measured rate that holds it (a dip at a lower rate, e.g. cold caches at the first
    step, does not end the hold)."""
    pts = sorted(points)
    if not pts:
        return Crossing(None, "no rates")
    held = [i for i, (_, a) in enumerate(pts) if a >= threshold]
    if not held:
        return Crossing(None, "below at every rate")
    i = held[-1]
    if i == len(pts) - 1:
        return Crossing(pts[-1][0], "not reached")
    (r0, a0), (r1, a1) = pts[i], pts[i + 1]
    return Crossing(r0 + (a0 - threshold) / (a0 - a1) * (r1 - r0), "interpolated")


def at_rate(points: list[tuple[float, float]], rate: float) -> float | None:
    """Attainment at `rate`, interpolated linearly between the measured rates around it (the
    lowest measured rate's below it; None above the highest)."""
    pts = sorted(points)
    if not pts or rate > pts[-1][0]:
        return None
    if rate <= pts[0][0]:
        return pts[0][1]
    for (r0, a0), (r1, a1) in pairwise(pts):
        if r0 <= rate <= r1:
            return a0 + (a1 - a0) * (rate - r0) / (r1 - r0) if r1 > r0 else a1
    return None


def summary(results: dict[str, list[StepResult]]) -> dict:
    """Issue 52's two figures: `slo`'s attainment at the rate where `default` falls through 80%,
    and each mode's highest rate held at >= 90% with the ratio slo / default."""
    points = {m: [(s.rate, s.attainment) for s in steps if s.attainment is not None] for m, steps in results.items()}
    out: dict = {"held_90": {}}
    for mode, pts in points.items():
        c = crossing(pts, 0.90)
        out["held_90"][mode] = {"rate": c.rate, "how": c.how}
    if "default" in points:
        c80 = crossing(points["default"], 0.80)
        out["default_80"] = {"rate": c80.rate, "how": c80.how}
        if "slo" in points and c80.rate is not None:
            out["default_80"]["slo_attainment"] = at_rate(points["slo"], c80.rate)
    held = out["held_90"]
    if "slo" in held and "default" in held and held["slo"]["rate"] and held["default"]["rate"]:
        out["held_90_ratio_slo_default"] = held["slo"]["rate"] / held["default"]["rate"]
    return out
