"""`prefixgate bench serving`: the serving path's ceiling, engine cost taken away.

A local stack of `--engine sim` replicas whose modelled costs are all near zero (1 ms decode
steps, no per-sequence or prefill cost), one gateway, and streaming clients in a process of their
own that parse every SSE event as JSON. What is left to measure is the path from the engine's
step to the client: per stream count, output tokens/s (counted from `usage`), SSE events per
request, TTFT p50/p99 and the CPU seconds per 1,000 output tokens of the gateway processes
(the HTTP front and the Gateway replicas) and of the replica processes. `--ingress proxy haproxy`
measures each HTTP front (gateway/ingress.py) on a stack of its own, one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import psutil

from gateway.config import AppConfig
from gateway.stack import APP_NAME, LocalStack
from loadtest.bench.stack_options import add_config_option, add_ingress_option, config_overrides
from loadtest.summary import percentile

# every modelled cost near zero: the engine is never the bottleneck (router/costs/service.py)
NEAR_ZERO_SERVICE = {"decode_step_s": 0.001, "decode_s_per_seq": 0.0, "prefill_overhead_s": 0.0,
                     "prefill_s_per_token": 1e-7, "max_running": 256}


@dataclass
class Level:
    ingress: str
    streams: int
    tokens_per_s: float
    events_per_request: float
    tokens_per_event: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    gateway_cpu_s_per_1k: float
    replica_cpu_s_per_1k: float
    failed: int


def _processes(deployment: str | None) -> list[psutil.Process]:
    """This stack's processes of one Serve deployment of our app (None: the HTTP front, Serve's
    proxy actor and, with `--ingress haproxy`, HAProxy and its manager actor), among this process's descendants: the
    local Ray node is ours, and another stack on the machine is not counted."""
    titles = ("ray::ProxyActor", "ray::HAProxyManager", "haproxy") if deployment is None else (f"ray::ServeReplica:{APP_NAME}:{deployment}",)
    out = []
    for proc in psutil.Process().children(recursive=True):
        try:
            cmd = proc.cmdline()
        except psutil.Error:
            continue
        if cmd and (cmd[0].startswith(titles) or os.path.basename(cmd[0]) in titles):
            out.append(proc)
    return out


def _cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def measure(stack: LocalStack, model: str, streams: int, requests: int, max_tokens: int) -> Level:
    gateway = _processes(None) + _processes("Gateway")
    replicas = _processes("PrefixCacheReplica")
    g0, r0 = _cpu_s(gateway), _cpu_s(replicas)
    out = subprocess.run(
        [sys.executable, "-m", "loadtest.bench.serving_client", "--base", stack.url, "--model", model,
         "--streams", str(streams), "--requests", str(requests), "--max-tokens", str(max_tokens)],
        capture_output=True, text=True, check=True)
    g1, r1 = _cpu_s(gateway), _cpu_s(replicas)
    run = json.loads(out.stdout)
    ok = [r for r in run["results"] if "error" not in r and r["ttft_s"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    events = sum(r["events"] for r in ok)
    ttfts = [r["ttft_s"] * 1000 for r in ok]
    per_1k = 1000 / tokens if tokens else float("nan")
    return Level(stack.ingress, streams, tokens / run["wall_s"], events / max(len(ok), 1), tokens / max(events, 1),
                 percentile(ttfts, 50) or 0.0, percentile(ttfts, 99) or 0.0,
                 (g1 - g0) * per_1k, (r1 - r0) * per_1k, len(run["results"]) - len(ok))


def format_table(levels: list[Level]) -> str:
    head = (f"{'ingress':>7} {'streams':>7} {'out tok/s':>10} {'events/req':>10} {'tok/event':>9} {'TTFT p50':>9} "
            f"{'TTFT p99':>9} {'gw CPU s/1k':>11} {'rep CPU s/1k':>12} {'failed':>6}")
    rows = [f"{lv.ingress:>7} {lv.streams:>7} {lv.tokens_per_s:>10.0f} {lv.events_per_request:>10.1f} {lv.tokens_per_event:>9.1f} "
            f"{lv.ttft_p50_ms:>7.1f}ms {lv.ttft_p99_ms:>7.1f}ms {lv.gateway_cpu_s_per_1k:>11.3f} "
            f"{lv.replica_cpu_s_per_1k:>12.3f} {lv.failed:>6}" for lv in levels]
    return "\n".join([head, *rows])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="prefixgate bench serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--gateways", type=int, default=1)
    p.add_argument("--streams", type=int, nargs="+", default=[16, 64, 128], help="concurrent streams, one level each")
    p.add_argument("--requests", type=int, default=2, help="completions per stream, one after another")
    p.add_argument("--max-tokens", type=int, default=300, help="output tokens per completion (ignore_eos)")
    add_ingress_option(p, several=True)
    p.add_argument("--port", type=int, default=8123)
    add_config_option(p, "stream_interval_ms=0")
    p.add_argument("--json", metavar="FILE", help="also write the levels as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if len(args.ingress) > 1:  # Ray reads the ingress switches once per process: one process each
        levels = [lv for ingress in args.ingress for lv in _in_own_process(argv or sys.argv[1:], ingress)]
        print(format_table(levels), flush=True)
    else:
        levels = run(args, args.ingress[0])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([lv.__dict__ for lv in levels], fh, indent=1)
    return 0


def child_argv(argv: list[str], ingress: str, json_path: str) -> list[str]:
    """The arguments of this benchmark's run with one ingress: argv less its --ingress and
    --json values, then the one ingress and the child's JSON file."""
    keep, skip = [], False
    for arg in argv:
        if arg in ("--ingress", "--json"):
            skip = True
        elif not (skip and not arg.startswith("--")):
            skip = False
            keep.append(arg)
    return [*keep, "--ingress", ingress, "--json", json_path]


def _in_own_process(argv: list[str], ingress: str) -> list[Level]:
    """This benchmark with one ingress, as a child process; its levels."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "levels.json")
        subprocess.run([sys.executable, "-m", "loadtest.bench.serving_bench", *child_argv(argv, ingress, out)],
                       check=True)
        with open(out) as fh:
            return [Level(**row) for row in json.load(fh)]


def run(args: argparse.Namespace, ingress: str) -> list[Level]:
    overrides = config_overrides(args)
    peak = max(args.streams)
    # a Redis of its own ('auto'): AppConfig's default names a deployment's, and a stack
    # without one routes every request `stale` and runs flow control without heartbeats
    config = AppConfig(engine="sim", replicas=args.replicas, gateways=args.gateways, sim_service=dict(NEAR_ZERO_SERVICE),
                       max_num_seqs=peak, max_ongoing_requests=peak, max_queued_requests=peak, max_model_len=8192,
                       **{"redis_url": "auto", **overrides})
    stack = LocalStack(config, port=args.port, ingress=ingress)
    levels: list[Level] = []
    try:
        stack.start()
        import httpx

        model = httpx.get(f"{stack.url}/v1/models", timeout=10).json()["data"][0]["id"]
        measure(stack, model, min(args.streams), 1, 16)  # warm-up: connections, first-call paths
        for streams in args.streams:
            levels.append(measure(stack, model, streams, args.requests, args.max_tokens))
            print(format_table(levels[-1:]).splitlines()[-1] if levels[:-1] else format_table(levels), flush=True)
    finally:
        stack.stop()
    return levels


if __name__ == "__main__":
    sys.exit(main())
