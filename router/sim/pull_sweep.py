"""Where pulling K/V stops paying: affinity-pull against affinity over link speed and K/V size.

    python -m router.sim.pull_sweep --replicas 8 --bandwidth 3 6 12 25 50 100 --kv 80e3 320e3 1.3e6

For each (K/V bytes per token, link GB/s) the simulator replays the workload under
affinity-pull with that transfer model, beside affinity (which never pulls) in the same run,
and prints hit rate (pulled blocks counted), share of blocks pulled, TTFT p50/p99 and bytes per
request. The break-even link speed of the model (`TransferModel.breakeven_bytes_per_s`) is
printed per K/V size: below it no pull beats recomputing and the policy stops choosing them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from router.costs.service import ServiceModel
from router.policy import make_policy
from router.sim.cli import BASE_REPLICAS, capacity_blocks, default_trace, make_transfer
from router.sim.engine import SimConfig, run_policy
from router.sim.oracle import pooled_lru_hits
from router.sim.workload import WORKLOADS, distinct_blocks, load_mooncake


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m router.sim.pull_sweep", description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=["mooncake", *WORKLOADS], default="mooncake")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--capacity", default="tight")
    p.add_argument("--bandwidth", type=float, nargs="+", default=[3, 6, 12, 25, 50, 100], help="GB/s")
    p.add_argument("--kv", type=float, nargs="+", default=[80e3, 320e3, 1.3e6], help="K/V bytes per token")
    p.add_argument("--fixed-s", type=float, default=None, help="fixed cost per pull (default: the model's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workload == "mooncake":
        requests = load_mooncake(default_trace(), limit=args.limit)
    else:
        requests = WORKLOADS[args.workload]().generate(seed=args.seed)[: args.limit]
    if not requests or min(args.bandwidth) <= 0 or min(args.kv) <= 0:
        print("pull_sweep: empty workload or non-positive bandwidth / K/V size", file=sys.stderr)
        return 2
    service = ServiceModel()
    cap = capacity_blocks(args.capacity, distinct_blocks(requests))
    total = sum(len(r.hashes) for r in requests)
    pooled = pooled_lru_hits(requests, cap * args.replicas) / total
    base = SimConfig(replicas=args.replicas, capacity_blocks=cap, service=service,
                     time_scale=args.replicas / BASE_REPLICAS)
    aff = run_policy(requests, make_policy("affinity", seed=args.seed), base)
    aff.hit_vs_pooled = aff.hit_rate / pooled
    print(f"{args.workload}, {args.replicas} replicas x {cap} blocks ({args.capacity}); pooled-LRU oracle {pooled:.1%}")
    print(f"affinity (no pulls): hit {aff.hit_rate / pooled:.1%} of pooled, TTFT p50 {aff.ttft_p50_s:.2f} s, "
          f"p99 {aff.ttft_p99_s:.2f} s, imbalance {aff.imbalance_p95:.2f}")
    print(f"{'KV/token':>9}{'GB/s':>6}{'breakeven':>11}{'hit/pooled':>12}{'pulled':>8}{'p50':>8}{'p99':>8}"
          f"{'imbal':>7}{'MB/req':>8}{'pull p50':>10}{'pull p99':>10}")
    rows = []
    for kv in args.kv:
        for gbs in args.bandwidth:
            overrides = {"kv_bytes_per_token": kv, "bytes_per_s": gbs * 1e9}
            if args.fixed_s is not None:
                overrides["fixed_s"] = args.fixed_s
            transfer = make_transfer(service, overrides)
            config = dataclasses.replace(base, transfer=transfer)
            r = run_policy(requests, make_policy("affinity-pull", seed=args.seed, transfer=transfer), config)
            r.hit_vs_pooled = r.hit_rate / pooled
            pulled = r.pulled_blocks / r.prompt_blocks
            pull50 = f"{r.pull_p50_s * 1000:.0f} ms" if r.pulled_blocks else "-"
            pull99 = f"{r.pull_p99_s * 1000:.0f} ms" if r.pulled_blocks else "-"
            print(f"{kv / 1e3:>7.0f}KB{gbs:>6g}{transfer.breakeven_bytes_per_s() / 1e9:>9.2f}GB"
                  f"{r.hit_rate / pooled:>12.1%}{pulled:>8.1%}{r.ttft_p50_s:>7.2f}s{r.ttft_p99_s:>7.2f}s"
                  f"{r.imbalance_p95:>7.2f}{r.bytes_per_request / 1e6:>8.0f}{pull50:>10}{pull99:>10}", flush=True)
            rows.append({"kv_bytes_per_token": kv, "gb_s": gbs, **r.to_dict()})
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"oracle_pooled": pooled, "affinity": aff.to_dict(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
