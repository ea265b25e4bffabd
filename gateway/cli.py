"""The `prefixgate` command: serve, chat, bench, sim, loadtest."""

from __future__ import annotations

import argparse
import sys
import time

from gateway import shutdown
from gateway.config import AppConfig, check_role_counts
from gateway.config_cli import add_config_args, config_values
from gateway.fleet_args import add_fleet_args, sim_service_overrides
from gateway.ingress import DEFAULT_INGRESS, INGRESSES
from gateway.local_redis import port_in_use


def _serve_args(p: argparse.ArgumentParser) -> None:
    """The stack's own flags; every AppConfig setting comes as a flag too (gateway/config_cli.py)."""
    p.add_argument("--redis-url", default=None, help="Redis to use (default: $REDIS_URL, else start a local one)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--ray-address", default=None, help="join an existing Ray cluster instead of starting one")
    p.add_argument("--ingress", choices=INGRESSES, default=DEFAULT_INGRESS,
                   help="what takes HTTP on --port: Serve's Python proxy, or HAProxy forwarding to the gateways' own "
                        "HTTP servers with Serve's throughput settings (gateway/ingress.py; not with --ray-address)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="the local Ray node exports every replica's and router's metrics at http://127.0.0.1:P/metrics "
                        "(with --ray-address: set it on `ray start --metrics-export-port` instead)")
    add_config_args(p.add_argument_group("settings", "AppConfig (gateway/config.py); the same names in Serve config files"))
    add_fleet_args(p)


def config_from_args(args: argparse.Namespace) -> AppConfig:
    import os

    values = config_values(args)
    shorthand = sim_service_overrides(args)
    if shorthand:
        values["sim_service"] = {**values.get("sim_service", {}), **shorthand}
    values["redis_url"] = args.redis_url or os.environ.get("REDIS_URL") or "auto"
    check_role_counts(values)  # --replicas beside --prefill-replicas / --decode-replicas
    return AppConfig(**values)


def cmd_serve(args: argparse.Namespace) -> int:
    import httpx

    from gateway.stack import LocalStack
    from gateway.startup import StackNotReady
    from replica.default_model import resolve_model
    from router.index.redis_index import redact

    if not shutdown.supervised():  # the stack runs in a process group of its own (gateway/shutdown.py)
        return shutdown.supervise(["serve", *args.argv])
    shutdown.install()  # SIGTERM/SIGINT from here on, start-up included, end in stack.stop() and exit 0
    shutdown.become_subreaper()  # and what the stack starts cannot outlive it unseen
    stack = None
    try:
        try:
            config = config_from_args(args)
        except ValueError as e:  # a setting out of its range, an unknown policy or engine
            print(f"[prefixgate] {e}", file=sys.stderr)
            return 2
        if args.ray_address and config.redis_url == "auto":
            print("[prefixgate] --ray-address needs --redis-url (or REDIS_URL): replicas on other nodes "
                  "cannot reach a Redis started on 127.0.0.1 here", file=sys.stderr)
            return 2
        if args.ray_address and args.ingress != DEFAULT_INGRESS:
            print(f"[prefixgate] --ingress {args.ingress} applies to a Ray this command starts: a cluster joined with "
                  "--ray-address takes it from its nodes' environment (docs/deploy.md)", file=sys.stderr)
            return 2
        taken = [f"--{flag} {port}" for flag, port in (("port", args.port), ("metrics-port", args.metrics_port))
                 if port and not args.ray_address and port_in_use(args.host if flag == "port" else "127.0.0.1", port)]
        if taken:
            print(f"[prefixgate] {', '.join(taken)}: in use by another process on this machine", file=sys.stderr)
            return 2
        stack = LocalStack(config, port=args.port, host=args.host, ray_address=args.ray_address,
                           metrics_port=args.metrics_port, ingress=args.ingress)
        models = config.model_configs()
        for model in models:
            resolve_model(model.model)  # convert the bundled model once, before replicas start
        replicas = ", ".join((f"{m.prefill_replicas} prefill + {m.decode_replicas} decode {m.engine} replicas" if m.split
                              else f"{m.replicas} {m.engine} replicas") + (f" of {m.served_name}" if len(models) > 1 else "")
                             for m in models)
        print(f"[prefixgate] starting: {replicas}, {config.gateways} gateway(s), "
              f"policy {config.policy}, port {args.port} ({args.ingress})", flush=True)
        if args.ray_address and args.metrics_port:
            print("[prefixgate] --metrics-port is ignored with --ray-address: each node exports at the port "
                  "its `ray start --metrics-export-port` gave", file=sys.stderr)
        try:
            stack.start()
        except StackNotReady as e:  # say which deployment or dependency is not ready, and why
            print(f"[prefixgate] not ready: {e}", file=sys.stderr, flush=True)
            return 1
        # with API keys set, /v1/models wants one too: any configured key will do
        auth = {"authorization": f"Bearer {next(iter(config.api_keys))}"} if config.api_keys else {}
        name = httpx.get(f"{stack.url}/v1/models", headers=auth).json()["data"][0]["id"]
        print(f"\n[prefixgate] serving {name} at {stack.url}/v1  (Redis: {redact(stack.config.redis_url)})")
        if stack.metrics_port and not args.ray_address:
            print(f"[prefixgate] metrics of every replica and router (Ray): http://127.0.0.1:{stack.metrics_port}/metrics")
        print("[prefixgate] try:\n"
              f"  curl {stack.url}/v1/chat/completions -H 'content-type: application/json' -H 'x-session-id: demo' \\\n"
              f"    -d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}]}}'")
        demo = httpx.post(
            f"{stack.url}/v1/chat/completions",
            json={"model": name, "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32},
            headers={"x-session-id": "demo", **auth}, timeout=120,
        ).json()
        print(f"[prefixgate] demo answer: {demo['choices'][0]['message']['content']!r}  usage: {demo['usage']}")
        print("[prefixgate] serving until Ctrl-C", flush=True)
        if args.exit_after_demo:
            return 0
        while True:  # until a signal raises ShutdownRequested here
            time.sleep(3600)
    except (shutdown.ShutdownRequested, KeyboardInterrupt) as e:
        print(f"[prefixgate] {e or 'interrupted'}: shutting down", flush=True)
    finally:
        shutdown.ignore()  # the stop is bounded: no signal cuts it short, however we got here
        if stack is not None:
            stack.stop()
            print("[prefixgate] stopped", flush=True)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from gateway.chat_client import run_chat

    return run_chat(args.url, args.session)


# Subcommands whose parser lives with their entry point: the raw argv after the name goes there
# untouched (options, --help and all), so `prefixgate sim --replicas 8` is `python -m router.sim.cli --replicas 8`.
DELEGATED = {
    "bench": (None, "benchmarks: engine, router, serving"),
    "sim": ("router.sim.cli", "replay a trace through simulated replicas, policy against policy"),
    "loadtest": ("loadtest.cli", "Locust load tests against the gateway"),
}
BENCHES = {
    "engine": ("loadtest.bench.engine_bench", "the engine: prefix reuse, batched decode, memory"),
    "router": ("loadtest.bench.router_bench", "the router's Redis index: lookup latency per fleet size"),
    "serving": ("loadtest.bench.serving_bench", "the serving path's ceiling: sim replicas at near-zero cost, streaming clients"),
    "lora": ("loadtest.bench.lora_bench", "LoRA decode: rows over several adapters against base-model rows"),
    "lora-routing": ("loadtest.bench.lora_routing", "LoRA routing: adapter-aware against adapter-blind, live"),
    "noisy-neighbour": ("loadtest.bench.noisy_neighbour", "flow control: a quiet tenant's TTFT beside a flood, off and on"),
    "overload": ("loadtest.bench.overload", "flow control under 3x overload: complete or 429 before the first byte"),
    "goodput": ("loadtest.bench.goodput", "goodput: requests/s meeting TTFT and TPOT objectives on a fixed mix, slo vs default vs least-loaded"),
    "pd": ("loadtest.bench.pd_bench", "prefill/decode split against colocated serving, live; --kill-prefill-every for faults"),
}


def build_parser() -> argparse.ArgumentParser:
    """`prefixgate --help`; serve and chat parse here, the delegated subcommands in their own modules."""
    parser = argparse.ArgumentParser(prog="prefixgate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="bring up Redis, Ray, replicas and the gateway locally")
    _serve_args(p)
    p.add_argument("--exit-after-demo", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(fn=cmd_serve)
    p = sub.add_parser("chat", help="terminal chat against a running gateway (shows cached tokens per turn)")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--session", default=None)
    p.set_defaults(fn=cmd_chat)
    for name, (_, text) in DELEGATED.items():  # listed in the help; main() forwards them before parsing
        sub.add_parser(name, help=text, add_help=False)
    return parser


def _bench_parser() -> argparse.ArgumentParser:
    """`prefixgate bench` with no benchmark named, or --help: which ones there are."""
    p = argparse.ArgumentParser(prog="prefixgate bench", description="Benchmarks; each takes its own options "
                                "(`prefixgate bench engine --help`).")
    sub = p.add_subparsers(dest="what", required=True)
    for name, (_, text) in BENCHES.items():
        sub.add_parser(name, help=text, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        name, rest = argv[0], argv[1:]
        if name == "bench":
            if not rest or rest[0] not in BENCHES:
                _bench_parser().parse_args(rest)  # prints the help, or says what is wrong; exits
                return 2
            name, rest = f"bench_{rest[0]}", rest[1:]
        return _delegate(name, rest)
    args = build_parser().parse_args(argv)
    args.argv = argv[1:]  # as typed, for a command that re-runs itself (serve under its supervisor)
    return args.fn(args)


def _delegate(name: str, rest: list[str]) -> int:
    import importlib

    if name.startswith("bench_"):
        module = BENCHES[name.removeprefix("bench_")][0]
    else:
        module = DELEGATED[name][0]
    return importlib.import_module(module).main(rest)


if __name__ == "__main__":
    sys.exit(main())
