"""Summary statistics from raw per-request records (JSON lines written by the locustfile).

Pure functions, so the numbers in docs/loadtest.md can be checked by unit tests. A record is a
dict with at least: ts (send time, epoch s), ok, prompt_tokens, cached_tokens,
completion_tokens, ttft_s, latency_s, replica; chat turns add session, turn, prev_replica.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from router.sim.metrics import percentile as sim_percentile

COLUMNS = (
    ("policy", "policy", "{}"),
    ("requests", "requests", "{}"),
    ("hit_rate", "hit rate", "{:.1%}"),
    ("later_turn_hit_rate", "hit t>=2", "{:.1%}"),
    ("stickiness", "sticky", "{:.0%}"),
    ("ttft_p50_s", "TTFT p50", "{:.3f}s"),
    ("ttft_p99_s", "TTFT p99", "{:.3f}s"),
    ("tpot_p50_s", "TPOT p50", "{:.3f}s"),
    ("output_tokens_per_s", "out tok/s", "{:.1f}"),
    ("prefill_tokens", "prefill computed", "{}"),
    ("later_turn_prefill_tokens", "prefill t>=2", "{}"),
    ("errors", "errors", "{}"),
    ("aborted", "cut off", "{}"),
)


def load_records(path: str | Path) -> list[dict]:
    """Records from a JSON-lines file; a torn last line (killed writer) is skipped."""
    out = []
    p = Path(path)
    if not p.exists():
        return out
    with p.open() as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def percentile(values: Iterable[float], q: float) -> float | None:
    """The simulator's percentile (numpy's default interpolation), None when empty: a run's
    report leaves a figure out rather than print nan."""
    xs = list(values)
    return sim_percentile(xs, q) if xs else None


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def summarize(records: list[dict], label: str | None = None, bin_s: float = 10.0) -> dict:
    """The numbers of one run. Token sums and latencies count successful requests only; a
    failed request counts in `errors` (by kind in `error_kinds`), one still in flight when the
    run hit its time limit in `aborted`."""
    ok = [r for r in records if r.get("ok")]
    failed = [r for r in records if not r.get("ok") and not r.get("aborted")]
    aborted = [r for r in records if r.get("aborted")]
    prompt = sum(r.get("prompt_tokens", 0) for r in ok)
    cached = sum(r.get("cached_tokens", 0) for r in ok)
    completion = sum(r.get("completion_tokens", 0) for r in ok)
    later = [r for r in ok if (r.get("turn") or 0) >= 2]
    sticky_pool = [r for r in later if r.get("prev_replica") and r.get("replica")]
    stayed = sum(1 for r in sticky_pool if r["replica"] == r["prev_replica"])
    ttfts = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    tpots = [r["tpot_s"] for r in ok if r.get("tpot_s") is not None]
    start = min((r["ts"] for r in records), default=0.0)
    end = max((r["ts"] + (r.get("latency_s") or 0.0) for r in records), default=0.0)
    duration = max(end - start, 0.0)
    return {
        "policy": label,
        "requests": len(records),
        "ok": len(ok),
        "errors": len(failed),
        "aborted": len(aborted),  # in flight when the run hit its time limit
        "error_kinds": dict(Counter(str(r.get("error") or "unknown")[:80] for r in failed)),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefill_tokens": prompt - cached,
        "completion_tokens": completion,
        "hit_rate": _ratio(cached, prompt),
        "later_turn_hit_rate": _ratio(sum(r.get("cached_tokens", 0) for r in later),
                                      sum(r.get("prompt_tokens", 0) for r in later)),
        "later_turn_prefill_tokens": sum(r.get("prompt_tokens", 0) - r.get("cached_tokens", 0) for r in later),
        "session_turns": len(sticky_pool),
        "stayed": stayed,
        "stickiness": _ratio(stayed, len(sticky_pool)),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        "tpot_p50_s": percentile(tpots, 50),
        "latency_p50_s": percentile([r["latency_s"] for r in ok if r.get("latency_s") is not None], 50),
        "duration_s": duration,
        "output_tokens_per_s": _ratio(completion, duration),
        "replicas": dict(Counter(r.get("replica") or "none" for r in ok)),
        "routes": dict(Counter(r.get("route") or "none" for r in ok)),
        "timeline": timeline(records, bin_s, start),
    }


def timeline(records: list[dict], bin_s: float = 10.0, start: float | None = None) -> list[dict]:
    """Per time bin (by send time): requests, hit rate, TTFT p50/p99, so warm-up shows."""
    if not records:
        return []
    t0 = min(r["ts"] for r in records) if start is None else start
    bins: dict[int, list[dict]] = {}
    for r in records:
        bins.setdefault(int((r["ts"] - t0) // bin_s), []).append(r)
    out = []
    for b in sorted(bins):
        rs = [r for r in bins[b] if r.get("ok")]
        ttfts = [r["ttft_s"] for r in rs if r.get("ttft_s") is not None]
        out.append({
            "t_s": b * bin_s,
            "requests": len(bins[b]),
            "errors": len(bins[b]) - len(rs),
            "hit_rate": _ratio(sum(r.get("cached_tokens", 0) for r in rs), sum(r.get("prompt_tokens", 0) for r in rs)),
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99),
        })
    return out


def _cell(row: dict, key: str, fmt: str) -> str:
    v = row.get(key)
    return "-" if v is None else fmt.format(v)


def format_table(rows: list[dict], markdown: bool = False) -> str:
    """One line per run: the comparison table printed by `compare` and pasted into the docs."""
    heads = [h for _, h, _ in COLUMNS]
    cells = [[_cell(r, k, f) for k, _, f in COLUMNS] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(heads) + " |", "|" + "|".join("---" for _ in heads) + "|"]
        lines += ["| " + " | ".join(c) + " |" for c in cells]
        return "\n".join(lines)
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(heads)]
    fmt_line = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt_line.format(*heads), *(fmt_line.format(*c) for c in cells)])
