"""`prefixgate loadtest trace` and `prefixgate loadtest fleet`.

trace   replay a contiguous slice of the Mooncake trace against a running gateway (open loop,
        prompts as token ids), then the simulator on the same rows; prints both side by side
fleet   bring up sim replicas and, per replica count and policy, deploy afresh, replay, simulate;
        one table, fleet.json and fleet.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import httpx
import redis

from loadtest.fleet import (
    FLEET_POLICIES,
    FleetSpec,
    live_run,
    run_fleet,
    save_json,
    settings_for,
    workload,
)
from loadtest.fleet_report import FleetResult, RunSettings, format_side_by_side, oracles, sim_result
from router import registry
from router.costs.service import ServiceModel
from router.sim.cli import (
    add_lora_flags,
    add_tier_flags,
    default_trace,
    lora_settings,
    parse_overrides,
)


def _rows_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("rows and scaling (identical for the live run and the simulator)")
    g.add_argument("--trace", default=None, help="Mooncake trace (default: shared/traces/...)")
    g.add_argument("--start", type=int, default=0, help="first row of the contiguous slice")
    g.add_argument("--requests", type=int, default=1000, help="rows in the slice")
    g.add_argument("--block-size", type=int, default=16, help="tokens per trace hash id (the trace's 512)")
    g.add_argument("--max-output", type=int, default=8, help="output tokens per request, at most")
    g.add_argument("--load-scale", default="auto", help="trace arrivals sped up by this; auto = replicas/8")
    g.add_argument("--time-scale", dest="wall_scale", type=float, default=1.0,
                   help="the modelled system runs this much faster in wall time (arrivals and service "
                        "model alike); below 1 to keep the replicas' step lag under 10%%")
    g.add_argument("--service", action="append", default=[], metavar="KEY=VALUE",
                   help="ServiceModel override, stated for 512-token blocks (repeatable)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", type=Path, default=None, help="write the results here")
    add_tier_flags(p)
    add_lora_flags(p)


def _spec(args: argparse.Namespace, replicas: list[int], policies: list[str]) -> FleetSpec:
    mix, lora = lora_settings(args)
    if len(args.lora_aware) > 1:
        raise ValueError("--lora-aware: one arm per live run (run the fleet once per arm)")
    return FleetSpec(
        trace=str(args.trace or default_trace()), start=args.start, requests=args.requests, replicas=replicas,
        policies=policies, capacity=args.capacity, block_size=args.block_size, max_output=args.max_output,
        load_scale=args.load_scale, wall_scale=args.wall_scale, gateways=getattr(args, "gateways", 1),
        seed=args.seed, service=dataclasses.replace(ServiceModel(), **parse_overrides(args.service)),
        host_blocks=args.host_blocks, disk_blocks=args.disk_blocks, host_rate=args.host_rate, disk_rate=args.disk_rate,
        adapters=mix, lora=lora, lora_aware=args.lora_aware[0],
    )


def _header(spec: FleetSpec, s: RunSettings, n_rows: int, dropped: int, pooled: float, unbounded: float) -> str:
    below = f" + host {s.tiers.host_blocks} + disk {s.tiers.disk_blocks}" if s.tiers.blocks else ""
    mix = spec.adapters
    if mix.adapters:
        below += (f"; {mix.adapters} LoRA adapters (Zipf {mix.zipf_s:g}, preambles of {mix.preamble_blocks} blocks), "
                  f"max_cpu_loras {s.lora.max_cpu_loras}, reads {s.lora.load_ms:g} ms, lora_aware {str(s.lora_aware).lower()}")
    return (f"== rows {spec.start}..{spec.start + spec.requests - 1} ({n_rows} replayed, {dropped} too large for a "
            f"replica), {s.replicas} replicas x {s.capacity_blocks} blocks of {s.block_size} tokens{below}, load scale "
            f"{s.load_scale:g}, time scale {s.wall_scale:g}; pooled-LRU oracle {pooled:.1%}, unbounded {unbounded:.1%}")


def cmd_trace(args: argparse.Namespace) -> int:
    try:
        spec = _spec(args, [args.replicas], [args.policy])
    except ValueError as e:
        print(f"prefixgate loadtest trace: {e}", file=sys.stderr)
        return 2
    requests = workload(spec)
    if not requests:
        print("prefixgate loadtest trace: no rows", file=sys.stderr)
        return 2
    spec.capacity = str(args.num_blocks)
    s, kept, dropped = settings_for(spec, requests, args.replicas)
    print(_header(spec, s, len(kept), dropped, *oracles(kept, s)), flush=True)
    t0 = time.time()
    try:
        live = live_run(args.url.rstrip("/"), spec, s, args.policy, kept, args.redis_url, args.key_prefix)
    except (httpx.HTTPError, redis.RedisError) as e:
        print(f"prefixgate loadtest trace: {args.url}: {e!r}", file=sys.stderr)
        return 2
    sim = sim_result(args.policy, kept, s, spec.service)
    print(f"[trace] replayed in {time.time() - t0:.0f}s; TTFTs in model seconds")
    print(format_side_by_side([(live, sim)]))
    if args.json:
        save_json([(live, sim)], spec, args.json)
    return 0 if live.errors == 0 and live.valid else 1


def cmd_fleet(args: argparse.Namespace) -> int:
    try:
        policies = registry.resolve_list(args.policies)
        spec = _spec(args, args.replicas, policies)
    except ValueError as e:
        print(f"prefixgate loadtest fleet: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path("loadtest/results") / f"fleet-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    pairs: list[tuple[FleetResult, FleetResult]] = []

    def show(live: FleetResult, sim: FleetResult) -> None:
        pairs.append((live, sim))
        print(format_side_by_side([(live, sim)]).splitlines()[-1], flush=True)
        save_json(pairs, spec, args.json or out / "fleet.json")

    requests = workload(spec)
    for n in spec.replicas:
        s, kept, dropped = settings_for(spec, requests, n)
        print(_header(spec, s, len(kept), dropped, *oracles(kept, s)), flush=True)
    print(format_side_by_side([]), flush=True)
    t0 = time.time()
    run_fleet(spec, show, ray_address=args.ray_address)
    print(f"\n[fleet] {len(pairs)} runs in {time.time() - t0:.0f}s; TTFTs in model seconds")
    print(format_side_by_side(pairs))
    from loadtest.fleet_plot import plot_fleet

    data = json.loads((args.json or out / "fleet.json").read_text())
    png = plot_fleet(data["runs"], args.plot or out / "fleet.png",
                     title=f"Mooncake rows {spec.start}+{spec.requests}, capacity {spec.capacity}, "
                           f"block {spec.block_size}, max output {spec.max_output}")
    print(f"[fleet] {args.json or out / 'fleet.json'}, {png}")
    return 0 if all(a.errors == 0 and a.valid for a, _ in pairs) else 1


def _load_pairs(paths: list[Path]) -> tuple[list[dict], list[tuple[FleetResult, FleetResult]]]:
    names = {f.name for f in dataclasses.fields(FleetResult)}
    runs = [run for p in paths for run in json.loads(Path(p).read_text())["runs"]]
    pairs = [tuple(FleetResult(**{k: v for k, v in r[side].items() if k in names}) for side in ("live", "sim"))
             for r in runs]
    return runs, pairs


def cmd_fleet_report(args: argparse.Namespace) -> int:
    """One table and one PNG from several fleet.json files (e.g. one stack run per policy)."""
    runs, pairs = _load_pairs(args.results)
    print(format_side_by_side(pairs))
    if args.plot:
        from loadtest.fleet_plot import plot_fleet

        print(f"[fleet] {plot_fleet(runs, args.plot, title=args.title)}")
    return 0


def _policy_arg(name: str) -> str:
    try:
        return registry.resolve(name)
    except ValueError as e:  # argparse shows this message, not a bare "invalid value"
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parsers(sub) -> None:
    p = sub.add_parser("trace", help="replay a Mooncake slice against a running gateway, then the simulator")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--replicas", type=int, required=True, help="replicas the gateway routes to (for the simulator)")
    p.add_argument("--num-blocks", type=int, required=True, help="K/V blocks per replica (for the simulator)")
    p.add_argument("--policy", default=registry.DEFAULT_POLICY, type=_policy_arg,
                   help=f"the gateway's policy (label, and the simulator's): {registry.help_text()}")
    p.add_argument("--redis-url", default=None, help="with --key-prefix: read the replicas' step lag")
    p.add_argument("--key-prefix", default=None)
    _rows_args(p)
    p.set_defaults(fn=cmd_trace, capacity="0")

    p = sub.add_parser("fleet", help="policies x replica counts on sim replicas, live and simulated")
    p.add_argument("--replicas", type=int, nargs="+", default=[16])
    p.add_argument("--policies", default=",".join(FLEET_POLICIES),
                   help=f"comma-separated; Ray's are simulated by their nearest of ours; names: {registry.help_text()}")
    p.add_argument("--capacity", default="0.02",
                   help="blocks per replica: a fraction of the slice's distinct blocks (0.02, 2%%) or a count")
    p.add_argument("--gateways", type=int, default=1, help="gateway (router) replicas")
    p.add_argument("--ray-address", default=None)
    p.add_argument("--out", default=None, help="output folder (default: loadtest/results/fleet-<time>)")
    p.add_argument("--plot", type=Path, default=None, help="PNG path (default: <out>/fleet.png)")
    _rows_args(p)
    p.set_defaults(fn=cmd_fleet)

    p = sub.add_parser("fleet-report", help="one table (and PNG) from several fleet.json files")
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--title", default=None)
    p.set_defaults(fn=cmd_fleet_report)
