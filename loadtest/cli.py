"""`prefixgate loadtest run|compare|summarize|plot|trace|fleet|headtohead|audit`: Locust runs and policy comparisons.

run        one headless Locust run against a running gateway: Locust CSVs, records.jsonl,
           summary.json
compare    one stack, redeployed once per routing policy (cold caches each time), the same
           seeded load against each; prints one table, writes compare.json and compare.png
summarize  one summary from one or more records.jsonl files (e.g. from several Locust machines)
plot       redraw the PNG from a summary.json or compare.json
trace      open-loop Mooncake replay against a running gateway, beside the simulator on the
           same rows (loadtest/fleet_cli.py, docs/fleet.md)
fleet      sim replicas x policies x replica counts, live and simulated side by side
headtohead the same 2 vLLM-sized replicas under prefixgate and Ray Serve LLM, one system at a
           time, the same clients (vLLM's bench serve, Locust chats); one table per client
audit      the live routing audit of a run recorded with `prefixgate serve --audit-dir DIR`: each
           request's lost prompt tokens by cause (loadtest/live_audit.py, docs/routing-audit.md)

Locust runs as a subprocess of this interpreter (`python -m locust`), so its gevent
monkey-patching never touches the Ray driver that `compare` holds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

from loadtest.locust_run import REPO, LoadSpec, run_locust
from loadtest.summary import format_table, load_records, summarize
from router import registry

DEFAULT_OUT = REPO / "loadtest" / "results"
# The default comparison: a choice among the registry's names (tests check they are in it), the
# default policy first; `affinity` stays the base the checks' ratios are taken against.
# `ray-pow2` is the row docs/loadtest.md's tables label `pow2` (Ray's default router, renamed).
DEFAULT_COMPARE = tuple(dict.fromkeys((registry.DEFAULT_POLICY, "affinity", "prefix", "session", "ray-pow2",
                                       "random", "ray-prefix", "ray-session")))


# Presets fill every setting the command line leaves unset.
PRESETS: dict[str, dict] = {
    # 2 CPU replicas of the default model, ample cache (~700 blocks each): every system prompt
    # fits everywhere, so where a session's later turns land is what tells policies apart.
    # Think times of 2-4 s keep the replicas out of saturation (and queue-length routers honest).
    "small": dict(replicas=2, users=8, system_prompts=4, system_tokens=256, user_tokens=16, turns=7,
                  sessions_per_user=1, max_tokens=24, think_min=2.0, think_max=4.0, duration_s=150,
                  spawn_rate=8.0),
    # The same machine, caches too small for the system prompts: 8 prompts of ~480 tokens
    # (30 blocks each, 240 in all) against 150 blocks per replica, short two-turn chats.
    "tight": dict(replicas=2, users=8, system_prompts=8, system_tokens=480, user_tokens=16, turns=2,
                  sessions_per_user=4, max_tokens=16, think_min=1.0, think_max=2.0, duration_s=150,
                  spawn_rate=8.0, num_blocks=150),
    # A GPU cluster: more replicas, users and prompts; run with --ray-address auto.
    "cluster": dict(replicas=8, users=64, system_prompts=32, system_tokens=1500, user_tokens=120,
                    turns=6, sessions_per_user=4, max_tokens=128, think_min=2.0, think_max=6.0,
                    duration_s=900, spawn_rate=8.0),
}


def _add_load_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load (unset: the preset's value, else LoadSpec's default)")
    g.add_argument("--preset", choices=sorted(PRESETS), default=None)
    g.add_argument("--workload", default=None, help="chat | trace | chat,trace")
    g.add_argument("-u", "--users", type=int, default=None)
    g.add_argument("-r", "--spawn-rate", type=float, default=None)
    g.add_argument("-t", "--duration", dest="duration_s", type=int, default=None,
                   help="hard time limit per run, seconds")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--system-prompts", type=int, default=None)
    g.add_argument("--system-tokens", type=int, default=None)
    g.add_argument("--user-tokens", type=int, default=None)
    g.add_argument("--turns", type=int, default=None)
    g.add_argument("--turns-min", type=int, default=None,
                   help="uneven sessions: each chat has uniform [turns-min, turns] turns (0: all have --turns)")
    g.add_argument("--sessions-per-user", type=int, default=None, help="0: keep chatting until --duration")
    g.add_argument("--think-min", type=float, default=None)
    g.add_argument("--think-max", type=float, default=None)
    g.add_argument("--max-tokens", type=int, default=None)
    g.add_argument("--trace-file", default=None)
    g.add_argument("--trace-start", type=int, default=None)
    g.add_argument("--trace-requests", type=int, default=None)
    g.add_argument("--trace-speedup", type=float, default=None)
    g.add_argument("--trace-block-tokens", type=int, default=None)
    g.add_argument("--trace-max-prompt", type=int, default=None)
    g.add_argument("--trace-max-output", type=int, default=None)
    p.add_argument("--out", default=None, help=f"output folder (default: {DEFAULT_OUT}/<command>-<time>)")


def _preset(args: argparse.Namespace) -> dict:
    return dict(PRESETS[args.preset]) if getattr(args, "preset", None) else {}


def spec_from_args(args: argparse.Namespace) -> LoadSpec:
    preset = _preset(args)
    values = {}
    for f in fields(LoadSpec):
        v = getattr(args, f.name, None)
        if v is None:
            v = preset.get(f.name)
        if v is not None:
            values[f.name] = v
    return LoadSpec(**values)


def _out_dir(args: argparse.Namespace, command: str) -> Path:
    out = Path(args.out) if args.out else DEFAULT_OUT / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    return out


# ---- run ----------------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    out = _out_dir(args, "run")
    print(f"[loadtest] {spec.workload}: {spec.users} users against {args.url}; output in {out}", flush=True)
    s = run_locust(spec, args.url, out, args.label)
    print(format_table([s]))
    print(f"[loadtest] summary: {out / 'summary.json'}")
    if args.plot:
        from loadtest.plot import plot_runs

        plot_runs([s], out / "summary.png", title=f"{args.url} ({spec.workload})")
    clean = s["requests"] > 0 and not s["errors"] and not s["aborted"]
    return 0 if clean and s.get("locust_exit_code") in (0, 1) else 1


# ---- compare ------------------------------------------------------------------------------------
def _warm_up(url: str, n: int, tag: str) -> None:
    """A few short requests so no replica pays its first-call overhead inside the measured run;
    under one block (16 tokens) each, so they leave nothing in the cache."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]

    def one(i: int) -> None:
        httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"model": model, "prompt": f"Warm {tag} {i}.", "max_tokens": 2, "temperature": 0})

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(one, range(n)))


def _compare_checks(rows: list[dict]) -> list[str]:
    """Ratios the docs' targets are stated in, against affinity."""
    by = {r["policy"]: r for r in rows}
    base = by.get("affinity")
    if not base:
        return []
    out = []
    for name, r in by.items():
        if name == "affinity":
            continue
        parts = [name]
        if base["prefill_tokens"]:
            parts.append(f"prefill vs affinity {r['prefill_tokens'] / base['prefill_tokens']:.2f}x")
        if r.get("hit_rate") and base.get("hit_rate") is not None:
            parts.append(f"affinity hit rate {base['hit_rate'] / r['hit_rate']:.2f}x of it")
        if r.get("ttft_p50_s") and base.get("ttft_p50_s"):
            parts.append(f"TTFT p50 {r['ttft_p50_s'] / base['ttft_p50_s']:.2f}x affinity's")
        out.append(", ".join(parts))
    return out


def cmd_compare(args: argparse.Namespace) -> int:
    from gateway.config import AppConfig
    from gateway.local_redis import free_port
    from gateway.stack import APP_NAME, LocalStack

    preset = _preset(args)
    spec = spec_from_args(args)
    try:
        policies = registry.resolve_list(args.policies)
    except ValueError as e:
        print(f"prefixgate loadtest compare: {e}", file=sys.stderr)
        return 2
    replicas = args.replicas or preset.get("replicas", 2)
    num_blocks = args.num_blocks if args.num_blocks is not None else preset.get("num_blocks")
    out = _out_dir(args, "compare")
    run_id = time.strftime("%H%M%S")
    port = args.port or free_port()

    def config(policy: str) -> AppConfig:
        return AppConfig(
            model=args.model, replicas=replicas, policy=policy, redis_url=args.redis_url or "auto",
            key_prefix=f"loadtest-{run_id}-{policy}", num_blocks=num_blocks, kv_cache_mb=args.kv_cache_mb,
            max_model_len=args.max_model_len, default_max_tokens=spec.max_tokens, seed=spec.seed,
            replica_num_cpus=args.replica_cpus, replica_num_gpus=args.replica_gpus, device=args.device,
            audit_dir=str(out / policy / "audit") if args.audit else None,
        )

    settings = {"policies": policies, "replicas": replicas, "num_blocks": num_blocks,
                "kv_cache_mb": args.kv_cache_mb, "load": asdict(spec), "argv": sys.argv}
    print(f"[loadtest] compare {', '.join(policies)}: {replicas} replicas, num_blocks={num_blocks or 'from kv_cache_mb'}, "
          f"{spec.users} users x {spec.sessions_per_user} chats x {spec.turns} turns; output in {out}", flush=True)
    t_start = time.time()
    stack = LocalStack(config(policies[0]), port=port, host=args.host, ray_address=args.ray_address)
    rows: list[dict] = []
    try:
        stack.start()
        url = args.url or stack.url
        for i, policy in enumerate(policies):
            t0 = time.time()
            if i > 0:
                from ray import serve

                serve.delete(APP_NAME)  # fresh replicas: every policy starts with cold caches
                stack.deploy(config(policy))
            _warm_up(url, 2 * replicas, f"{run_id}-{policy}")
            t_ready = time.time()
            s = run_locust(spec, url, out / policy, policy)
            s["deploy_s"] = t_ready - t0
            try:
                import httpx

                (out / policy / "metrics.txt").write_text(httpx.get(f"{url}/metrics", timeout=10).text)
            except Exception as e:  # the table does not depend on it
                print(f"[loadtest] /metrics not saved: {e!r}", file=sys.stderr)
            if args.audit:
                s["audit"] = _audit(out / policy, t_ready, time.time())
            rows.append(s)
            print(f"[loadtest] {policy}: {s['requests']} requests, hit {_pct(s['hit_rate'])}, "
                  f"{s['errors']} errors, {s['aborted']} cut off by -t, deploy {s['deploy_s']:.0f}s + run {s['wall_s']:.0f}s", flush=True)
    finally:
        stack.stop()
    result = {"settings": settings, "runs": rows, "checks": _compare_checks(rows), "elapsed_s": time.time() - t_start}
    (out / "compare.json").write_text(json.dumps(result, indent=2))
    _print_compare(result)
    from loadtest.plot import plot_runs

    png = plot_runs(rows, out / "compare.png", title=_title(result))
    print(f"[loadtest] {out / 'compare.json'}, {png}; {time.time() - t_start:.0f}s in all")
    return 0 if rows and all(r["requests"] for r in rows) else 1


def _audit(out: Path, start: float, end: float) -> dict | None:
    """One policy's live routing audit over its Locust run (loadtest/live_audit.py)."""
    from loadtest.live_audit import audit_dir, report

    try:
        result = audit_dir(out / "audit", window=(start, end))
    except (ValueError, OSError) as e:
        print(f"[loadtest] no audit: {e}", file=sys.stderr)
        return None
    text = report(result)
    (out / "audit.txt").write_text(text + "\n")
    print(f"[loadtest] {out.name}: {text}", flush=True)
    return {**result.summary.to_dict(), "decisions": result.decisions, "unmatched": result.unmatched}


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _title(result: dict) -> str:
    s = result.get("settings", {})
    load = s.get("load", {})
    return (f"{s.get('replicas')} replicas, num_blocks={s.get('num_blocks') or 'default'}; {load.get('workload')}: "
            f"{load.get('users')} users, {load.get('system_prompts')} system prompts x ~{load.get('system_tokens')} tok, "
            f"{load.get('turns')} turns, max_tokens {load.get('max_tokens')}")


def _print_compare(result: dict) -> None:
    rows = result["runs"]
    print(_title(result))
    print(format_table(rows))
    for line in _compare_checks(rows):
        print("  " + line)


# ---- summarize ----------------------------------------------------------------------------------
def cmd_summarize(args: argparse.Namespace) -> int:
    """Records from several Locust machines (or runs) -> one summary."""
    records = [r for path in args.records for r in load_records(path)]
    s = summarize(records, args.label or None)
    print(format_table([s]))
    if args.output:
        Path(args.output).write_text(json.dumps(s, indent=2))
        print(f"[loadtest] wrote {args.output}")
    return 0 if records else 1


# ---- plot ---------------------------------------------------------------------------------------
def cmd_plot(args: argparse.Namespace) -> int:
    from loadtest.plot import plot_runs

    data = json.loads(Path(args.summary).read_text())
    runs = data["runs"] if "runs" in data else [data]
    out = Path(args.output) if args.output else Path(args.summary).with_suffix(".png")
    plot_runs(runs, out, title=_title(data) if "runs" in data else None)
    if "runs" in data:
        _print_compare(data)
    print(f"[loadtest] wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefixgate loadtest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="one headless Locust run against a running gateway")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--label", default="", help="stored in the records and summary (e.g. the policy)")
    p.add_argument("--plot", action="store_true", help="also write summary.png")
    _add_load_args(p)
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("compare", help="the same load against each routing policy")
    p.add_argument("--policies", default=",".join(DEFAULT_COMPARE),
                   help=f"comma-separated, first is deployed first; names: {registry.help_text()}")
    p.add_argument("--replicas", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=None, help="K/V blocks per replica (default: from --kv-cache-mb)")
    p.add_argument("--kv-cache-mb", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--model", default=None, help="local HF model directory (default: bundled SmolLM2-135M)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--replica-cpus", type=float, default=0.5)
    p.add_argument("--replica-gpus", type=float, default=0.0)
    p.add_argument("--redis-url", default=None, help="default: start a local redis-server")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (e.g. auto) instead of starting one")
    p.add_argument("--host", default="127.0.0.1", help="Serve HTTP bind address")
    p.add_argument("--port", type=int, default=None, help="Serve HTTP port (default: a free one)")
    p.add_argument("--url", default=None, help="send load here instead of http://127.0.0.1:PORT")
    p.add_argument("--audit", action="store_true", help="record each policy's live routing audit and print its lost "
                   "prompt tokens by cause (loadtest/live_audit.py, docs/routing-audit.md)")
    _add_load_args(p)
    p.set_defaults(fn=cmd_compare)

    from loadtest.fleet_cli import add_parsers

    add_parsers(sub)  # trace, fleet

    from loadtest.headtohead import add_parser as add_headtohead

    add_headtohead(sub)  # prefixgate against Ray Serve LLM on the same replicas (loadtest/headtohead.py)
    from loadtest.live_audit import add_parser as add_audit

    add_audit(sub)  # the live routing audit of a run recorded with --audit-dir

    p = sub.add_parser("summarize", help="summary of one or more records.jsonl files")
    p.add_argument("records", nargs="+")
    p.add_argument("--label", default="")
    p.add_argument("-o", "--output", default=None, help="write the summary JSON here")
    p.set_defaults(fn=cmd_summarize)

    p = sub.add_parser("plot", help="redraw the PNG from summary.json or compare.json")
    p.add_argument("summary")
    p.add_argument("-o", "--output", default=None)
    p.set_defaults(fn=cmd_plot)

    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
