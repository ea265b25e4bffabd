"""Figures of a run with the step model or a prefill/decode split (router/sim/pd_engine.py).

TTFT: arrival to first token (for a handed-over request: its prefill, the K/V transfer, then
the decode replica's first step). TPOT: (finish - first token) / (output tokens - 1), for
requests with more than one output token. Goodput (DistServe's, as `prefixgate bench goodput`
scores it, loadtest/bench/goodput_score.py): requests of the classes with objectives that met
both their TTFT and TPOT objectives, per second of the run's arrival span; attainment the share
of those requests that did.
"""

from __future__ import annotations

import math

from router.sim.metrics import PdStats, percentile
from router.sim.pd_replica import PdJob


def tpot(job: PdJob) -> float | None:
    out = job.req.output_tokens
    return (job.done - job.first_token) / (out - 1) if out > 1 else None


def pd_stats(jobs: list[PdJob], span_s: float, objectives: dict[str, tuple[float, float]],
             prefill_replicas: int, decode_replicas: int, threshold: int, kv_bytes_per_token: float) -> PdStats:
    """`jobs`: the measured requests, finished. `objectives`: class -> (TTFT s, TPOT s)."""
    ttfts = [j.ttft for j in jobs]
    tpots = [t for j in jobs if (t := tpot(j)) is not None]
    handed = [j for j in jobs if j.handed]
    transfers = [j.transfer_s for j in handed]
    moved = sum(j.transfer_tokens for j in handed) * kv_bytes_per_token
    stats = PdStats(
        prefill_replicas, decode_replicas, threshold, len(jobs), len(handed),
        percentile(ttfts, 50), percentile(ttfts, 99), percentile(tpots, 50), percentile(tpots, 99),
        sum(transfers) / len(transfers) if transfers else math.nan, percentile(transfers, 99),
        moved / len(jobs) / 1e6 if jobs else 0.0,
    )
    by_class: dict[str, list[PdJob]] = {}
    for j in jobs:
        by_class.setdefault(j.req.kind or "all", []).append(j)
    met_total = judged = 0
    for kind, group in sorted(by_class.items()):
        row: dict[str, float] = {
            "n": len(group),
            "ttft_p50_s": percentile([j.ttft for j in group], 50),
            "ttft_p99_s": percentile([j.ttft for j in group], 99),
            "tpot_p50_s": percentile([t for j in group if (t := tpot(j)) is not None], 50),
            "tpot_p99_s": percentile([t for j in group if (t := tpot(j)) is not None], 99),
        }
        if kind in objectives:
            ttft_obj, tpot_obj = objectives[kind]
            met = sum(1 for j in group if j.ttft <= ttft_obj and (tpot(j) or 0.0) <= tpot_obj)
            row["attainment"] = met / len(group)
            met_total += met
            judged += len(group)
        stats.classes[kind] = row
    if objectives and span_s > 0:
        stats.goodput_rps = met_total / span_s
        stats.attainment = met_total / judged if judged else math.nan
    return stats
