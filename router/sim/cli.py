"""`prefixgate sim`: replay a trace through simulated replicas under each policy, print a table.

    python -m router.sim.cli --replicas 8 32 --capacity tight ample --json out/sim.json
    python -m router.sim.cli --replicas 8 --capacity 0.0025 --host-blocks 4x   # a host tier of 4 pools
    python -m router.sim.cli --replicas 8 --capacity 600 2000 --policies affinity --audit   # why hits were lost
    python -m router.sim.cli --workload chat --adapters 8 --max-cpu-loras 2 --lora-aware true false   # LoRA
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys
import time
from pathlib import Path

from router.costs.adapter_memory import LORA_LOAD_MS, LoraConfig
from router.costs.service import ServiceModel
from router.costs.transfer_model import TransferModel
from router.policy import POLICIES, AffinityPolicy, Policy, make_policy
from router.protocol.lora import MAX_CPU_LORAS
from router.sim.audit import RoutingAudit, pooled_lru_per_request
from router.sim.engine import SimConfig, run_policy
from router.sim.lora import AdapterMix
from router.sim.metrics import PolicyResult
from router.sim.oracle import pooled_lru_hits, unbounded_hits
from router.sim.replica import HOLDER_MODES
from router.sim.router_config import SimRouterConfig
from router.sim.tiers import TierConfig
from router.sim.workload import SESSION_MODES, WORKLOADS, SimRequest, distinct_blocks, load_mooncake

CAPACITY_PRESETS = {"tight": 0.01, "ample": 0.05}  # fraction of the workload's distinct blocks
BASE_REPLICAS = 8  # --time-scale auto keeps per-replica load at the trace's rate over 8 replicas
TRACE_NAME = "mooncake_conversation_trace.jsonl"


def default_trace() -> Path:
    root = Path(__file__).resolve().parents[2]
    for base in (root / "shared", root.parent / "shared"):
        if (base / "traces" / TRACE_NAME).exists():
            return base / "traces" / TRACE_NAME
    return root.parent / "shared" / "traces" / TRACE_NAME


def capacity_blocks(spec: str, distinct: int) -> int:
    """'tight'/'ample', a fraction of distinct blocks ('0.02' or '2%'), or blocks ('1500')."""
    if spec in CAPACITY_PRESETS:
        return max(1, round(CAPACITY_PRESETS[spec] * distinct))
    if spec.endswith("%"):
        return max(1, round(float(spec[:-1]) / 100 * distinct))
    if "." in spec:
        return max(1, round(float(spec) * distinct))
    return int(spec)


def parse_overrides(items: list[str]) -> dict[str, float]:
    """KEY=VALUE flags (dashes or underscores) -> dataclass field overrides."""
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        out[key.replace("-", "_")] = float(value)
    return out


def options_for(policy: str, options: dict[str, float]) -> dict[str, float]:
    """The --policy-opt options a policy's class takes (read from its signature): affinity's
    reach both affinity policies, the pull policy's own (copy_weight) it alone."""
    accepted = inspect.signature(POLICIES[policy].__init__).parameters
    if "affinity_options" in accepted:  # passes the rest on to AffinityPolicy
        accepted = {**accepted, **inspect.signature(AffinityPolicy.__init__).parameters}
    return {k: v for k, v in options.items() if k in accepted}


def sim_policy(name: str, seed: int, options: dict[str, float], transfer: TransferModel) -> Policy:
    """A policy as the simulator runs it: its --policy-opt options, and the simulator's transfer
    model where it prices copies (pulls, tier hits) instead of calibrating from heartbeats."""
    opts: dict = options_for(name, options)
    if "transfer" in inspect.signature(POLICIES[name].__init__).parameters:
        opts["transfer"] = transfer
    return make_policy(name, seed=seed, **opts)


def check_options(options: dict[str, float]) -> None:
    known = {p for cls in POLICIES.values() for p in inspect.signature(cls.__init__).parameters}
    unknown = sorted(set(options) - known - {"self", "seed", "transfer", "affinity_options"})
    if unknown:
        raise ValueError(f"unknown --policy-opt {', '.join(unknown)}")


def make_transfer(service: ServiceModel, overrides: dict[str, float]) -> TransferModel:
    """The pull model: GPU-like defaults, prefill rate taken from the service model (the policy
    prices a pull against the prefill the replicas really run), then the overrides."""
    return TransferModel(**{"prefill_tokens_per_s": 1.0 / service.prefill_s_per_token, **overrides})


# SimRouterConfig fields as flags: help, and where the default comes from
ROUTER_FLAGS = {
    "sampled_replicas": ("replicas scored for load alone, besides the matched and the session's",
                         "RouterOptions"),
    "session_ttl_s": ("how long a session's replica is remembered (Redis key and router memory)",
                      "RouterOptions"),
    "publish_depth": ("leading blocks of a prompt that are hashed and matched", "RouterOptions"),
    "load_refresh_s": ("load-table refresh period in simulated seconds, with --stale-loads",
                       "RouterOptions"),
    "inflight_ttl_s": ("how long a routed prefix counts as in flight", "INFLIGHT_TTL_S"),
    "stale_memory_s": ("how long a degraded decision remembers routed prefixes", "decider.STALE_MEMORY_S"),
    "lookup_sample": ("holders a lookup samples where a match ends", "RedisConfig.sample"),
    "lookup_keep": ("replicas a lookup reports at most", "RedisConfig.keep"),
    "index_down": ("probability that a lookup fails, so the decision takes the degraded (stale) path",
                   "simulator only"),
}


def add_router_flags(p: argparse.ArgumentParser) -> None:
    """The live router's options, defaults from `SimRouterConfig` (itself from the live router)."""
    defaults = SimRouterConfig()
    g = p.add_argument_group("router", "the live router's decision path (router/decider.py) and its options")
    for name, (text, source) in ROUTER_FLAGS.items():
        default = getattr(defaults, name)
        kind = float if name.endswith("_s") or isinstance(default, float) else int
        g.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default,
                       help=f"{text} (default {default}, from {source})")
    g.add_argument("--stale-loads", action="store_true",
                   help="load table refreshed every --load-refresh-s instead of exact at each decision")


def router_config(args: argparse.Namespace) -> SimRouterConfig:
    return SimRouterConfig(seed=args.seed, stale_loads=args.stale_loads,
                           **{name: getattr(args, name) for name in ROUTER_FLAGS})


def add_tier_flags(p: argparse.ArgumentParser) -> None:
    """Each replica's K/V tiers (here and in `prefixgate loadtest fleet`)."""
    g = p.add_argument_group("K/V tiers", "below each replica's pool, an LRU of its own replica (router/sim/tiers.py)")
    g.add_argument("--host-blocks", default="0", help="host tier per replica: blocks, or a multiple of the pool ('4x')")
    g.add_argument("--disk-blocks", default="0", help="disk tier per replica, below the host tier: blocks or '8x'")
    defaults = TransferModel()
    g.add_argument("--host-rate", type=float, default=defaults.host_bytes_per_s,
                   help=f"bytes/s of a host-tier hit back into the pool (default {defaults.host_bytes_per_s:g}, PCIe)")
    g.add_argument("--disk-rate", type=float, default=defaults.disk_bytes_per_s,
                   help=f"bytes/s of a disk-tier hit back into the pool (default {defaults.disk_bytes_per_s:g}, NVMe)")


def tier_rates(args: argparse.Namespace) -> dict[str, float]:
    """The tier-rate flags as TransferModel fields (the model prices pulls and tier copies alike)."""
    return {"host_bytes_per_s": args.host_rate, "disk_bytes_per_s": args.disk_rate}


def parse_bool(text: str) -> bool:
    """true/false as the live flags take them (`--lora-aware false`)."""
    value = text.strip().lower()
    if value not in ("true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value in ("true", "1", "yes")


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    """Sessions under LoRA adapters and each replica's adapter memory (router/sim/lora.py)."""
    mix = AdapterMix()
    g = p.add_argument_group("LoRA adapters", "sessions under adapters, each replica's adapters in host memory "
                                              "(router/sim/lora.py, docs/lora.md)")
    g.add_argument("--adapters", type=int, default=mix.adapters,
                   help="adapters the sessions are spread over (default 0: none, the base model only)")
    g.add_argument("--adapter-preamble-blocks", type=int, default=mix.preamble_blocks,
                   help=f"blocks of each adapter's own system prompt before its prompts (default {mix.preamble_blocks})")
    g.add_argument("--adapter-zipf", type=float, default=mix.zipf_s,
                   help=f"adapter popularity 1/(i+1)^s over sessions (default {mix.zipf_s:g}; 0: uniform)")
    g.add_argument("--max-cpu-loras", type=int, default=MAX_CPU_LORAS,
                   help=f"adapters resident in host memory per replica, least recently used out (default {MAX_CPU_LORAS})")
    g.add_argument("--lora-load-ms", type=float, default=LORA_LOAD_MS,
                   help=f"reading an adapter that is not resident from disk, before the prefill (default {LORA_LOAD_MS:g})")
    g.add_argument("--lora-aware", type=parse_bool, nargs="+", default=[True], metavar="{true,false}",
                   help="the router hashes and prices adapters (true, the live default) or routes as the base "
                        "model's (false, the blind baseline); 'true false' runs both arms")


def lora_settings(args: argparse.Namespace) -> tuple[AdapterMix, LoraConfig]:
    """The LoRA flags as the workload's adapter mix and the replicas' adapter memory."""
    if not args.adapters and len(args.lora_aware) > 1:
        raise ValueError("--lora-aware with two arms needs --adapters N (without adapters they are one)")
    mix = AdapterMix(args.adapters, args.adapter_preamble_blocks, args.adapter_zipf, SimConfig.block_size)
    return mix, LoraConfig(args.max_cpu_loras, args.lora_load_ms)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prefixgate sim", description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=["mooncake", *WORKLOADS], default="mooncake")
    p.add_argument("--trace", type=Path, default=None, help=f"Mooncake trace (default: shared/traces/{TRACE_NAME})")
    p.add_argument("--sessions", choices=SESSION_MODES, default="none",
                   help="Mooncake: no session ids (default), or pseudo-sessions from the first two block ids")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--replicas", type=int, nargs="+", default=[8, 32])
    p.add_argument("--capacity", nargs="+", default=["tight", "ample"],
                   help="per replica: tight (1%% of distinct blocks), ample (5%%), a fraction, or blocks")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    p.add_argument("--time-scale", default="auto",
                   help=f"arrival speed-up; auto = replicas/{BASE_REPLICAS} (same load per replica)")
    p.add_argument("--window", type=float, default=60.0, help="imbalance window, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="option for the affinity policies, e.g. miss_weight=1.5 (repeatable)")
    p.add_argument("--transfer", action="append", default=[], metavar="KEY=VALUE",
                   help="TransferModel override for K/V pulls (affinity-pull), e.g. bytes_per_s=3e9, "
                        "kv_bytes_per_token=1.3e6, fixed_s=0.005 (repeatable)")
    p.add_argument("--service", action="append", default=[], metavar="KEY=VALUE",
                   help="ServiceModel override, e.g. prefill_s_per_token=1e-4 (repeatable)")
    p.add_argument("--pull-holder", choices=HOLDER_MODES, default="keep",
                   help="what a pull does to the holder's copy in its LRU: keep its place (default), "
                        "touch (most recent, as the real engine's export today), demote (next to evict)")
    add_tier_flags(p)
    add_lora_flags(p)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--audit", action="store_true",
                   help="routing audit: split each run's gap to the pooled-LRU oracle into causes (lost tokens "
                        "per cause, per policy and capacity; docs/simulator.md)")
    p.add_argument("--audit-out", type=Path, default=None, metavar="FILE",
                   help="write the audit's per-request records here, one JSON line each (implies --audit)")
    add_router_flags(p)
    return p


def load_workload(args: argparse.Namespace, mix: AdapterMix | None = None) -> list[SimRequest]:
    """The workload's requests, their sessions spread over `mix`'s adapters (none by default)."""
    if args.workload == "mooncake":
        reqs = load_mooncake(args.trace or default_trace(), sessions=args.sessions, limit=args.limit)
    else:
        reqs = WORKLOADS[args.workload]().generate(seed=args.seed)
        reqs = reqs[: args.limit] if args.limit else reqs
    return mix.apply(reqs, args.seed) if mix is not None else reqs


def _ms(seconds: float, any_: bool) -> str:
    return f"{seconds * 1000:>8.1f}ms" if any_ else f"{'-':>10}"


def arm_name(aware: bool) -> str:
    return "aware" if aware else "blind"


def format_table(rows: list[PolicyResult], lora: bool = False) -> str:
    """One line per policy; `hit` = device + host + disk + pulled, each column its share of all
    prompt blocks; MB/req and pull p99 are the pulls', tier p99 the tier copies' time. With
    `lora`, each line also names its arm (lora_aware true or false) and the adapter disk reads
    per request (`loads/req`)."""
    arm_head, loads_head = (f"{'arm':<7}", f"{'loads/req':>11}") if lora else ("", "")
    head = (f"{'policy':<14}{arm_head}{'hit':>7}{'/pooled':>9}{'device':>8}{'host':>7}{'disk':>7}{'pulled':>8}"
            f"{'ttft p50':>10}{'ttft p99':>10}{'imbal p95':>11}{'util':>7}{'MB/req':>8}{'pull p99':>10}"
            f"{'tier p99':>10}{loads_head}  reasons")
    lines = [head]
    for r in rows:
        reasons = " ".join(f"{k}={v}" for k, v in sorted(r.reasons.items()))
        t = r.tier_shares
        arm = f"{arm_name(r.lora_aware):<7}" if lora else ""
        loads = f"{r.loads_per_request:>11.3f}" if lora else ""
        lines.append(
            f"{r.policy:<14}{arm}{r.hit_rate:>7.1%}{r.hit_vs_pooled:>9.1%}{t['device']:>8.1%}{t['host']:>7.1%}"
            f"{t['disk']:>7.1%}{t['pulled']:>8.1%}{r.ttft_p50_s:>9.2f}s{r.ttft_p99_s:>9.2f}s"
            f"{r.imbalance_p95:>11.2f}{r.utilization:>7.0%}{r.bytes_per_request / 1e6:>8.0f}"
            f"{_ms(r.pull_p99_s, r.pulled_blocks > 0)}{_ms(r.tier_p99_s, r.host_hit_blocks + r.disk_hit_blocks > 0)}"
            f"{loads}  {reasons}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        service = dataclasses.replace(ServiceModel(), **parse_overrides(args.service))
        policy_opts = parse_overrides(args.policy_opt)
        check_options(policy_opts)
        transfer = make_transfer(service, {**tier_rates(args), **parse_overrides(args.transfer)})
        router = router_config(args)
        TierConfig.from_flags(args.host_blocks, args.disk_blocks, 1)  # refuses bad tier flags before any run
        mix, lora = lora_settings(args)
        requests = load_workload(args, mix)
    except (OSError, TypeError, ValueError) as e:
        print(f"prefixgate sim: {e}", file=sys.stderr)
        return 2
    if not requests:
        print("prefixgate sim: empty workload", file=sys.stderr)
        return 2
    audit = args.audit or args.audit_out is not None
    audit_out = None
    if args.audit_out is not None:
        args.audit_out.parent.mkdir(parents=True, exist_ok=True)
        audit_out = args.audit_out.open("w")
    distinct = distinct_blocks(requests)
    total = sum(len(r.hashes) for r in requests)
    unbounded = unbounded_hits(requests) / total
    print(f"workload {args.workload}: {len(requests)} requests, {total} prompt blocks, "
          f"{distinct} distinct; unbounded-cache oracle hit {unbounded:.1%}")
    if mix.adapters:
        print(f"LoRA: {mix.adapters} adapters (Zipf {mix.zipf_s:g}, preambles of {mix.preamble_blocks} blocks), "
              f"max_cpu_loras {lora.max_cpu_loras}, disk read {lora.load_ms:g} ms; "
              f"arms: {', '.join(arm_name(a) for a in args.lora_aware)}")
    settings = []
    for n in args.replicas:
        scale = n / BASE_REPLICAS if args.time_scale == "auto" else float(args.time_scale)
        for spec in args.capacity:
            cap = capacity_blocks(spec, distinct)
            tiers = TierConfig.from_flags(args.host_blocks, args.disk_blocks, cap)
            combined = cap + tiers.blocks  # per replica, pool and tiers: the oracle's share of it
            pooled_hits = pooled_lru_hits(requests, combined * n)
            pooled = pooled_hits / total
            config = SimConfig(replicas=n, capacity_blocks=cap, service=service,
                               time_scale=scale, window_s=args.window, transfer=transfer,
                               pull_holder=args.pull_holder, router=router, tiers=tiers, lora=lora)
            rows = []
            audits: list[str] = []
            per_request = pooled_lru_per_request(requests, combined * n) if audit else None
            t0 = time.perf_counter()
            for aware, name in ((a, p) for a in args.lora_aware for p in args.policies):
                arm = dataclasses.replace(config, router=dataclasses.replace(router, lora_aware=aware))
                label = f"{name} ({arm_name(aware)})" if mix.adapters else name
                recorder = RoutingAudit(config.block_size, router.publish_depth) if audit else None
                result = run_policy(requests, sim_policy(name, args.seed, policy_opts, transfer), arm, recorder)
                result.hit_vs_pooled = result.hit_rate / pooled if pooled else float("nan")
                rows.append(result)
                if recorder is not None:
                    summary = recorder.summarize(per_request, result.hit_blocks + result.pulled_blocks, pooled_hits)
                    result.audit = summary.to_dict()
                    audits.append(f"\nrouting audit: {label}, {n} replicas x {cap} blocks\n{summary.format(total)}")
                    if audit_out is not None:
                        arm_label = {"lora_aware": aware} if mix.adapters else {}
                        recorder.write_jsonl(audit_out, policy=name, replicas=n, capacity_blocks=cap, **arm_label)
            below = f" + host {tiers.host_blocks} + disk {tiers.disk_blocks}" if tiers.blocks else ""
            print(f"\n== {n} replicas x {cap} blocks ({spec}){below}, time scale {scale:g}: "
                  f"pooled-LRU oracle hit {pooled:.1%} (at {combined * n} blocks), unbounded {unbounded:.1%} "
                  f"[{time.perf_counter() - t0:.0f}s]")
            print(format_table(rows, lora=bool(mix.adapters)))
            for text in audits:
                print(text)
            settings.append({
                "replicas": n, "capacity": spec, "capacity_blocks": cap, "time_scale": scale,
                "tiers": dataclasses.asdict(tiers), "oracle_pooled_blocks": combined * n,
                "oracle_unbounded": unbounded, "oracle_pooled": pooled,
                "rows": [r.to_dict() for r in rows],
            })
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "workload": args.workload, "requests": len(requests), "prompt_blocks": total,
            "distinct_blocks": distinct, "service": dataclasses.asdict(service),
            "policy_options": policy_opts, "transfer": dataclasses.asdict(transfer),
            "pull_holder": args.pull_holder, "router": dataclasses.asdict(router), "settings": settings,
        }
        if mix.adapters:
            payload["lora"] = {**dataclasses.asdict(mix), **dataclasses.asdict(lora), "arms": args.lora_aware}
        args.json.write_text(json.dumps(payload, indent=2))
    if audit_out is not None:
        audit_out.close()
        print(f"\naudit records: {args.audit_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
