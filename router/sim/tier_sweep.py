"""Where each K/V tier stops paying: one policy over tier sizes and tier rates.

    python -m router.sim.tier_sweep --replicas 8 --capacity 0.0025 --host-sizes 0 1 2 4 8 16 \\
        --host-rates 25 10 5 2.5 1 --disk-sizes 4 16 64 --disk-rates 4 2 1 0.5

Four axes, each from the baseline of the others: host tier size (multiples of the pool) at the
default rates; host rate (GB/s) at `--host-size`; disk tier size below a host tier of
`--host-size`; disk rate at `--disk-size`. Each row: hit rate against the pooled-LRU oracle at
that row's combined capacity, where the hits came from, TTFT, balance and the copies' p99. The
break-even rate (`TransferModel.breakeven_bytes_per_s`: K/V bytes per token x prefill tokens/s)
is printed: a tier slower than it copies a block back more slowly than recomputing it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from router.costs.service import ServiceModel
from router.policy import POLICIES
from router.sim.cli import BASE_REPLICAS, capacity_blocks, load_workload, make_transfer, sim_policy
from router.sim.engine import SimConfig, run_policy
from router.sim.metrics import PolicyResult
from router.sim.oracle import pooled_lru_hits
from router.sim.tiers import TierConfig
from router.sim.workload import WORKLOADS, distinct_blocks


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m router.sim.tier_sweep", description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=["mooncake", *WORKLOADS], default="mooncake")
    p.add_argument("--trace", type=Path, default=None)
    p.add_argument("--sessions", default="none")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--capacity", default="0.0025")
    p.add_argument("--policy", choices=list(POLICIES), default="affinity")
    p.add_argument("--host-sizes", type=float, nargs="*", default=[0, 1, 2, 4, 8, 16], help="x pool")
    p.add_argument("--host-size", type=float, default=4, help="x pool, for the rate and disk axes")
    p.add_argument("--host-rates", type=float, nargs="*", default=[25, 10, 5, 2.5, 1], help="GB/s")
    p.add_argument("--disk-sizes", type=float, nargs="*", default=[4, 16, 64], help="x pool, below the host tier")
    p.add_argument("--disk-size", type=float, default=16, help="x pool, for the disk-rate axis")
    p.add_argument("--disk-rates", type=float, nargs="*", default=[4, 2, 1, 0.5], help="GB/s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    return p


def axes(args: argparse.Namespace) -> list[tuple[str, float, float, dict[str, float]]]:
    """(label, host x pool, disk x pool, TransferModel overrides) per row, axis by axis."""
    rows = [(f"host {h:g}x", h, 0.0, {}) for h in args.host_sizes]
    rows += [(f"host {args.host_size:g}x @ {g:g} GB/s", args.host_size, 0.0, {"host_bytes_per_s": g * 1e9})
             for g in args.host_rates]
    rows += [(f"host {args.host_size:g}x + disk {d:g}x", args.host_size, d, {}) for d in args.disk_sizes]
    rows += [(f"+ disk {args.disk_size:g}x @ {g:g} GB/s", args.host_size, args.disk_size, {"disk_bytes_per_s": g * 1e9})
             for g in args.disk_rates]
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    requests = load_workload(args)
    if not requests:
        print("tier_sweep: empty workload", file=sys.stderr)
        return 2
    service = ServiceModel()
    cap = capacity_blocks(args.capacity, distinct_blocks(requests))
    total = sum(len(r.hashes) for r in requests)
    base = SimConfig(replicas=args.replicas, capacity_blocks=cap, service=service,
                     time_scale=args.replicas / BASE_REPLICAS)
    breakeven = make_transfer(service, {}).breakeven_bytes_per_s()
    print(f"{args.workload}, {args.replicas} replicas x {cap} blocks ({args.capacity}), {args.policy}; "
          f"break-even copy rate {breakeven / 1e9:.2f} GB/s")
    print(f"{'setting':<28}{'hit':>7}{'/pooled':>9}{'device':>8}{'host':>7}{'disk':>7}{'p50':>8}{'p99':>8}"
          f"{'imbal':>7}{'util':>6}{'copy p99':>10}")
    out = []
    for label, host, disk, overrides in axes(args):
        tiers = TierConfig(round(host * cap), round(disk * cap))
        transfer = make_transfer(service, overrides)
        config = dataclasses.replace(base, transfer=transfer, tiers=tiers)
        r: PolicyResult = run_policy(requests, sim_policy(args.policy, args.seed, {}, transfer), config)
        pooled = pooled_lru_hits(requests, (cap + tiers.blocks) * args.replicas) / total
        r.hit_vs_pooled = r.hit_rate / pooled
        t = r.tier_shares
        copy = f"{r.tier_p99_s * 1000:.0f} ms" if r.host_hit_blocks + r.disk_hit_blocks else "-"
        print(f"{label:<28}{r.hit_rate:>7.1%}{r.hit_vs_pooled:>9.1%}{t['device']:>8.1%}{t['host']:>7.1%}"
              f"{t['disk']:>7.1%}{r.ttft_p50_s:>7.2f}s{r.ttft_p99_s:>7.2f}s{r.imbalance_p95:>7.2f}"
              f"{r.utilization:>6.0%}{copy:>10}", flush=True)
        out.append({"setting": label, "tiers": dataclasses.asdict(tiers), "transfer": overrides,
                    "oracle_pooled": pooled, **r.to_dict()})
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"breakeven_bytes_per_s": breakeven, "rows": out}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
