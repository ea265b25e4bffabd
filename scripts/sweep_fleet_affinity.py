"""Affinity's knobs on a fleet run's rows and settings, in the simulator only (seconds).

Answers "could another setting of affinity match ray-prefix's live hit rate?" (docs/fleet.md,
third round) on exactly the rows, capacity and load scale `prefixgate loadtest fleet` uses:

    python scripts/sweep_fleet_affinity.py --replicas 32 --requests 2000 --load-scale 3.5 \
        --opt miss_weight=4,8,16,32,64
"""

from __future__ import annotations

import argparse
import itertools

from loadtest.fleet import FleetSpec, settings_for, workload
from loadtest.fleet_report import sim_result
from router.sim.cli import default_trace


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--capacity", default="0.02")
    p.add_argument("--load-scale", default="auto")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=V1,V2",
                   help="an AffinityPolicy argument and the values to try (repeatable: the grid of all)")
    args = p.parse_args()
    spec = FleetSpec(trace=str(default_trace()), start=args.start, requests=args.requests,
                     replicas=[args.replicas], capacity=args.capacity, load_scale=args.load_scale)
    s, kept, _ = settings_for(spec, workload(spec), args.replicas)
    grid = {k: [float(v) for v in vs.split(",")] for k, _, vs in (o.partition("=") for o in args.opt)}
    for values in itertools.product(*grid.values()):
        options = dict(zip(grid, values, strict=True))
        r = sim_result("affinity", kept, s, spec.service, options)
        print(f"{args.replicas} replicas {options or 'defaults'}: hit {r.hit_rate:.1%} "
              f"({r.hit_rate / r.oracle_pooled:.1%} of pooled), TTFT p50 {r.ttft_p50_s:.2f} s, p99 {r.ttft_p99_s:.2f} s")


if __name__ == "__main__":
    main()
