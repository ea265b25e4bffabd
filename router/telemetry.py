"""Metrics recorded through Ray's metrics API, created in the process that records them.

Every process of the app (replicas, the gateway and the router inside it) records with
`ray.serve.metrics`, which Ray's metrics agent on each node exports at the node's metrics
export port with a `ray_` prefix; inside a Serve replica Ray adds the `deployment`, `replica`
and `application` tags, and Ray adds `WorkerId` to all of them. So one Prometheus scrape per
node sees every replica and every router, which a scrape of one gateway's `/metrics` never did.

The Ray metric object is made lazily, on the first record in the recording process: Ray Serve
ships router classes to every process that holds a handle, so objects made at import time could
end up in the wrong process. A metric declared `local=True` also counts into this process's
prometheus_client registry, which the gateway's `/metrics` serves: an immediate, per-process
view for debugging and for tests that need a count at once (Ray exports on an interval).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

log = logging.getLogger("prefixgate.telemetry")

# seconds-scale buckets shared by our latency histograms
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metric:
    """One metric: kind is "counter", "gauge" or "histogram"; the API mirrors prometheus_client
    (`m.labels(*values).inc()`, `m.observe(x)`) so call sites stay one line."""

    def __init__(self, kind: str, name: str, doc: str, labels: Sequence[str] = (),
                 buckets: Sequence[float] | None = None, local: bool = False,
                 default_tags: dict[str, str] | None = None, ray: bool = True) -> None:
        if kind not in ("counter", "gauge", "histogram"):
            raise ValueError(f"unknown metric kind {kind!r}")
        if kind == "histogram" and not buckets:
            raise ValueError(f"histogram {name} needs buckets")
        self.kind, self.name, self.doc = kind, name, doc
        self.label_names = tuple(labels)
        self.buckets = tuple(buckets or ())
        self.default_tags = dict(default_tags or {})
        self._ray = None
        self._ray_failed = not ray  # ray=False: only this process's registry (local=True)
        self._local = _local_metric(kind, name, doc, self.label_names, self.buckets) if local else None
        self._lock = threading.Lock()

    # ---- recording ----------------------------------------------------------------------
    def labels(self, *values, **kv) -> _Bound:
        if values:
            if len(values) != len(self.label_names):
                raise ValueError(f"{self.name} takes labels {self.label_names}, got {values}")
            kv = dict(zip(self.label_names, values, strict=True))
        return _Bound(self, {k: str(v) for k, v in kv.items()})

    def inc(self, value: float = 1.0) -> None:
        self.labels().inc(value)

    def set(self, value: float) -> None:
        self.labels().set(value)

    def observe(self, value: float) -> None:
        self.labels().observe(value)

    def zero(self, *values: str) -> None:
        """Export a counter at 0 before its first event (with these label values), so the name
        is in every scrape and rate() reads 0 instead of "no data" (429s, retries, migrations
        may never happen). Call it in the recording process."""
        metric = self._ray_metric()
        if metric is None or self.kind != "counter":
            return
        tags = {**self.default_tags, **dict(zip(self.label_names, map(str, values), strict=True))}
        try:
            metric._record(0, tags=tags or None)  # Counter.inc refuses 0; the record path does not
        except Exception:
            log.exception("could not export %s at 0", self.name)

    def _record(self, op: str, value: float, tags: dict[str, str]) -> None:
        if self._local is not None:
            target = self._local.labels(**tags) if self.label_names else self._local
            getattr(target, op)(value)
        if op == "inc" and value <= 0:
            return  # Ray counters refuse 0
        metric = self._ray_metric()
        if metric is None:
            return
        tags = {**self.default_tags, **tags} if self.default_tags else tags
        if op == "inc":
            metric.inc(value, tags=tags or None)
        elif op == "set":
            metric.set(value, tags=tags or None)
        else:
            metric.observe(value, tags=tags or None)

    def _ray_metric(self):
        if self._ray is not None or self._ray_failed:
            return self._ray
        with self._lock:
            if self._ray is None and not self._ray_failed:
                self._ray = _make_ray_metric(self)
                self._ray_failed = self._ray is None
        return self._ray


class _Bound:
    __slots__ = ("metric", "tags")

    def __init__(self, metric: Metric, tags: dict[str, str]) -> None:
        self.metric, self.tags = metric, tags

    def inc(self, value: float = 1.0) -> None:
        self.metric._record("inc", value, self.tags)

    def set(self, value: float) -> None:
        self.metric._record("set", value, self.tags)

    def observe(self, value: float) -> None:
        self.metric._record("observe", value, self.tags)


def _make_ray_metric(m: Metric):
    """The Ray metric object, or None outside a Ray worker/driver (plain unit tests)."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        from ray.serve import metrics as serve_metrics

        tag_keys = tuple(dict.fromkeys((*m.label_names, *m.default_tags)))
        if m.kind == "counter":
            return serve_metrics.Counter(m.name, description=m.doc, tag_keys=tag_keys)
        if m.kind == "gauge":
            return serve_metrics.Gauge(m.name, description=m.doc, tag_keys=tag_keys)
        return serve_metrics.Histogram(m.name, description=m.doc, boundaries=list(m.buckets), tag_keys=tag_keys)
    except Exception:  # metrics must never break serving
        log.exception("could not create Ray metric %s", m.name)
        return None


def _local_metric(kind: str, name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...]):
    """This process's prometheus_client metric; reuses one another copy of a module made."""
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram

    existing = getattr(REGISTRY, "_names_to_collectors", {})
    if name in existing:
        return existing[name]
    if kind == "counter":
        return Counter(name, doc, labels)
    if kind == "gauge":
        return Gauge(name, doc, labels)
    return Histogram(name, doc, labels, buckets=buckets)
