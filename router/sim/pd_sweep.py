"""Prefill/decode splits against colocated replicas at equal replica counts (issue 53).

    python -m router.sim.pd_sweep --replicas 16 --splits 2:14 4:12 6:10 8:8 --seeds 0 1 2

Every arm replays the same requests with the step model (router/sim/pd_replica.py: decode
steps stretched by the prefill chunks beside them): `colocated` (every replica `both`) and each
split P:D (P prefill, D decode replicas) at each `--thresholds` value (a prompt is handed over
when its uncached part on the chosen decode replica is longer). Workload: the goodput
benchmark's mix (`--mix goodput`) or chat alone (`--mix chat`), at `--rate` requests/s per
replica, objectives calibrated as the benchmark does (router/sim/pd_workload.py).

Per arm: TTFT and TPOT p50/p99, share handed over, modelled transfer time per hand-over, K/V
moved per request, attainment of both objectives and goodput (requests/s meeting both), and
the ratios to colocated. The first seed chooses the split: best goodput among the arms that
keep up (TTFT p99 over all measured requests, the class without objectives included, at most
`--keep-up` x colocated's: a split whose prefill pool falls behind would otherwise win by
starving the batch class); the other seeds report it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from router.costs.service import ServiceModel
from router.policy import POLICIES
from router.sim.cli import make_transfer, parse_overrides, sim_policy
from router.sim.engine import PD_THRESHOLD_TOKENS, SimConfig, run_policy
from router.sim.metrics import PdStats, PolicyResult
from router.sim.pd_workload import CAPACITY_BLOCKS, MIXES, GoodputMixWorkload, calibrate, unloaded

COLOCATED = "colocated"


@dataclass
class Arm:
    label: str
    prefill: int
    decode: int
    threshold: int


def parse_split(text: str) -> tuple[int, int]:
    p, _, d = text.partition(":")
    try:
        return int(p), int(d)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a split is P:D, e.g. 4:12, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m router.sim.pd_sweep", description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[16])
    p.add_argument("--splits", type=parse_split, nargs="+", default=None,
                   help="P:D prefill:decode replicas, P + D = each --replicas (default: P = 1/8, 1/4, 3/8, 1/2 of them)")
    p.add_argument("--thresholds", type=int, nargs="+", default=[PD_THRESHOLD_TOKENS],
                   help=f"uncached tokens on the decode replica above which a prompt is handed over "
                        f"(default {PD_THRESHOLD_TOKENS}, llm-d's prefix-based-pd-decider)")
    p.add_argument("--mix", choices=list(MIXES), default="goodput", help="the goodput benchmark's mix, or chat alone")
    p.add_argument("--rate", type=float, default=5.0, help="requests/s per replica (default 5)")
    p.add_argument("--duration", type=float, default=60.0, help="measured seconds of arrivals (default 60)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="the first chooses the split")
    p.add_argument("--policy", choices=list(POLICIES), default="affinity")
    p.add_argument("--capacity", type=int, default=CAPACITY_BLOCKS, help="blocks of 16 tokens per replica")
    p.add_argument("--keep-up", type=float, default=2.0,
                   help="an arm is eligible when its TTFT p99 is at most this x colocated's (default 2)")
    p.add_argument("--service", action="append", default=[], metavar="KEY=VALUE", help="ServiceModel override")
    p.add_argument("--transfer", action="append", default=[], metavar="KEY=VALUE", help="TransferModel override")
    p.add_argument("--json", type=Path, default=None)
    return p


def arms_for(n: int, splits: list[tuple[int, int]] | None, thresholds: list[int]) -> list[Arm]:
    pairs = splits if splits is not None else [(n * k // 8, n - n * k // 8) for k in (1, 2, 3, 4)]
    out = [Arm(COLOCATED, 0, 0, PD_THRESHOLD_TOKENS)]
    for p, d in pairs:
        if p + d != n or p < 1 or d < 1:
            raise ValueError(f"split {p}:{d} does not divide {n} replicas into prefill and decode")
        out += [Arm(f"{p}:{d}" + (f" @{t}" if len(thresholds) > 1 else ""), p, d, t) for t in thresholds]
    return out


def _ms(x: float) -> str:
    return f"{x * 1000:>8.0f}" if not math.isnan(x) else f"{'-':>8}"


def format_rows(rows: list[tuple[Arm, PolicyResult]], chosen: str | None) -> str:
    base = rows[0][1].pd
    assert base is not None
    head = (f"{'arm':<12}{'TTFT p50':>9}{'p99':>8}{'TPOT p50':>9}{'p99':>8}{'handed':>8}{'xfer ms':>8}{'MB/req':>8}"
            f"{'attain':>8}{'goodput':>9}{'x good':>8}{'x TPOT99':>9}  (ms)")
    lines = [head]
    for arm, r in rows:
        s = r.pd
        assert s is not None
        mark = " <- chosen" if arm.label == chosen else ""
        lines.append(
            f"{arm.label:<12}{_ms(s.ttft_p50_s)}{_ms(s.ttft_p99_s)}{_ms(s.tpot_p50_s)}{_ms(s.tpot_p99_s)}"
            f"{s.handed_share:>8.1%}{_ms(s.transfer_mean_s)}{s.transfer_mb_per_request:>8.0f}{s.attainment:>8.1%}"
            f"{s.goodput_rps:>9.1f}{ratio(s.goodput_rps, base.goodput_rps):>8}{ratio(s.tpot_p99_s, base.tpot_p99_s):>9}{mark}")
    return "\n".join(lines)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and not math.isnan(a) and not math.isnan(b) else "-"


def choose(rows: list[tuple[Arm, PolicyResult]], keep_up: float) -> str | None:
    """Best goodput among the splits that keep up; ties by the lower TPOT p99."""
    base = rows[0][1].pd
    assert base is not None
    best: tuple[float, float, str] | None = None
    for arm, r in rows[1:]:
        s: PdStats | None = r.pd
        assert s is not None
        if s.ttft_p99_s > keep_up * base.ttft_p99_s:
            continue
        key = (s.goodput_rps, -s.tpot_p99_s, arm.label)
        if best is None or key[:2] > best[:2]:
            best = key
    return best[2] if best else None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        service = replace(ServiceModel(), **parse_overrides(args.service))
        transfer = make_transfer(service, parse_overrides(args.transfer))
        arms_by_n = {n: arms_for(n, args.splits, args.thresholds) for n in args.replicas}
    except (TypeError, ValueError) as e:
        print(f"pd_sweep: {e}", file=sys.stderr)
        return 2
    objectives = calibrate(service, transfer)
    print(f"mix {args.mix}, {args.rate:g} requests/s per replica, {args.duration:g} s measured, policy {args.policy}; "
          f"objectives: {unloaded(objectives)}")
    out: list[dict] = []
    for n in args.replicas:
        chosen: str | None = None
        for i, seed in enumerate(args.seeds):
            work = GoodputMixWorkload(rate=args.rate * n, duration_s=args.duration, classes=MIXES[args.mix])
            requests = work.generate(seed)
            rows = []
            t0 = time.perf_counter()
            for arm in arms_by_n[n]:
                config = SimConfig(replicas=n, capacity_blocks=args.capacity, block_size=work.block_size,
                                   service=service, transfer=transfer, step_model=True,
                                   prefill_replicas=arm.prefill, decode_replicas=arm.decode,
                                   pd_threshold_tokens=arm.threshold, objectives=objectives)
                rows.append((arm, run_policy(requests, sim_policy(args.policy, seed, {}, transfer), config)))
            if i == 0:
                chosen = choose(rows, args.keep_up)
            role = "chooses" if i == 0 else "reports"
            print(f"\n== {n} replicas, seed {seed} ({role}), {len(requests)} requests [{time.perf_counter() - t0:.0f}s]")
            print(format_rows(rows, chosen))
            for arm, r in rows:
                assert r.pd is not None
                out.append({"replicas": n, "seed": seed, "arm": arm.label, "prefill": arm.prefill,
                            "decode": arm.decode, "threshold": arm.threshold if arm.prefill else None, "chosen": arm.label == chosen,
                            **r.to_dict()})
        if chosen is None:
            print(f"\n{n} replicas: no split keeps up (TTFT p99 within {args.keep_up:g}x colocated's)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"mix": args.mix, "rate_per_replica": args.rate, "objectives": objectives,
                                         "rows": out}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
