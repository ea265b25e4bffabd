"""The `prefixgate` command: serve, chat, bench, sim, loadtest."""

from __future__ import annotations

import argparse
import json
import sys
import time

from gateway import shutdown
from gateway.config import AppConfig
from gateway.fleet_args import add_fleet_args, fleet_fields


def _serve_args(p: argparse.ArgumentParser) -> None:
    d = AppConfig()
    p.add_argument("--model", default=None, help="local Hugging Face model directory (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--model-name", default=None, help="served model name (default: the directory name)")
    p.add_argument("--replicas", type=int, default=d.replicas)
    p.add_argument("--policy", default=d.policy, help="affinity | affinity-pull | prefix | session | random | least-loaded | pow2 | ray-prefix | ray-session")
    p.add_argument("--redis-url", default=None, help="Redis to use (default: $REDIS_URL, else start a local one)")
    p.add_argument("--key-prefix", default=d.key_prefix)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--block-size", type=int, default=None, help="tokens per K/V block (default: 16; 32 with --engine vllm)")
    p.add_argument("--replica-threads", type=int, default=d.torch_threads, help="compute threads per replica (torch's, or vLLM's)")
    p.add_argument("--num-blocks", type=int, default=None, help="K/V blocks per replica (default: from --kv-cache-mb)")
    p.add_argument("--kv-cache-mb", type=int, default=d.kv_cache_mb)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--device", default=d.device)
    p.add_argument("--replica-cpus", type=float, default=d.replica_num_cpus)
    p.add_argument("--replica-gpus", type=float, default=d.replica_num_gpus)
    p.add_argument("--max-ongoing-requests", type=int, default=d.max_ongoing_requests)
    p.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests)
    p.add_argument("--api-keys", default=None, help="JSON file mapping API key -> tenant; enables 401 for others")
    p.add_argument("--ray-address", default=None, help="join an existing Ray cluster instead of starting one")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="the local Ray node exports every replica's and router's metrics at http://127.0.0.1:P/metrics "
                        "(with --ray-address: set it on `ray start --metrics-export-port` instead)")
    p.add_argument("--replica-resources", default=None, help='JSON of custom Ray resources per replica, e.g. {"replica_node": 1}')
    add_fleet_args(p)


def config_from_args(args: argparse.Namespace) -> AppConfig:
    import os

    api_keys = {}
    if args.api_keys:
        with open(args.api_keys) as f:
            api_keys = json.load(f)
    return AppConfig(
        model=args.model, model_name=args.model_name, replicas=args.replicas, policy=args.policy,
        redis_url=args.redis_url or os.environ.get("REDIS_URL") or "auto", key_prefix=args.key_prefix,
        block_size=args.block_size, num_blocks=args.num_blocks, kv_cache_mb=args.kv_cache_mb,
        max_model_len=args.max_model_len, device=args.device, replica_num_cpus=args.replica_cpus,
        replica_num_gpus=args.replica_gpus, max_ongoing_requests=args.max_ongoing_requests,
        max_queued_requests=args.max_queued_requests, api_keys=api_keys,
        replica_resources=json.loads(args.replica_resources) if args.replica_resources else {},
        torch_threads=args.replica_threads,
        **fleet_fields(args),
    )


def cmd_serve(args: argparse.Namespace) -> int:
    import httpx

    from gateway.stack import LocalStack
    from gateway.startup import StackNotReady
    from replica.default_model import resolve_model
    from router.redis_index import redact

    shutdown.install()  # SIGTERM/SIGINT from here on, start-up included, end in stack.stop() and exit 0
    shutdown.become_subreaper()  # and what the stack starts cannot outlive it unseen
    stack = None
    try:
        config = config_from_args(args)
        if args.ray_address and config.redis_url == "auto":
            print("[prefixgate] --ray-address needs --redis-url (or REDIS_URL): replicas on other nodes "
                  "cannot reach a Redis started on 127.0.0.1 here", file=sys.stderr)
            return 2
        stack = LocalStack(config, port=args.port, host=args.host, ray_address=args.ray_address,
                           metrics_port=args.metrics_port)
        resolve_model(config.model)  # convert the bundled model once, before replicas start
        print(f"[prefixgate] starting: {config.replicas} {config.engine} replicas, {config.gateways} gateway(s), "
              f"policy {config.policy}, port {args.port}", flush=True)
        if args.ray_address and args.metrics_port:
            print("[prefixgate] --metrics-port is ignored with --ray-address: each node exports at the port "
                  "its `ray start --metrics-export-port` gave", file=sys.stderr)
        try:
            stack.start()
        except StackNotReady as e:  # say which deployment or dependency is not ready, and why
            print(f"[prefixgate] not ready: {e}", file=sys.stderr, flush=True)
            return 1
        name = httpx.get(f"{stack.url}/v1/models").json()["data"][0]["id"]
        print(f"\n[prefixgate] serving {name} at {stack.url}/v1  (Redis: {redact(stack.config.redis_url)})")
        if stack.metrics_port and not args.ray_address:
            print(f"[prefixgate] metrics of every replica and router (Ray): http://127.0.0.1:{stack.metrics_port}/metrics")
        print("[prefixgate] try:\n"
              f"  curl {stack.url}/v1/chat/completions -H 'content-type: application/json' -H 'x-session-id: demo' \\\n"
              f"    -d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}]}}'")
        demo = httpx.post(
            f"{stack.url}/v1/chat/completions",
            json={"model": name, "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32},
            headers={"x-session-id": "demo"}, timeout=120,
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


def main(argv: list[str] | None = None) -> int:
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
    p = sub.add_parser("bench", help="benchmarks (engine)")
    p.add_argument("what", choices=["engine", "router"])
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=lambda a: _delegate(f"bench_{a.what}", a.rest))
    p = sub.add_parser("sim", help="replay a trace through simulated replicas, policy against policy", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=lambda a: _delegate("sim", a.rest))
    p = sub.add_parser("loadtest", help="Locust load tests against the gateway", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=lambda a: _delegate("loadtest", a.rest))
    args = parser.parse_args(argv)
    return args.fn(args)


def _delegate(name: str, rest: list[str]) -> int:
    if name == "sim":
        from router.sim.cli import main as entry
    elif name == "loadtest":
        from loadtest.cli import main as entry
    elif name == "bench_engine":
        from replica.bench import main as entry
    else:
        from router.bench import main as entry
    return entry(rest)


if __name__ == "__main__":
    sys.exit(main())
