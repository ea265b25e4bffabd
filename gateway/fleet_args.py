"""`prefixgate serve` flags for fleets: many gateways and simulated-compute replicas.

    prefixgate serve --engine sim --replicas 32 --gateways 2 --num-blocks 256 \\
        --sim-prefill-tokens-per-s 7000 --sim-decode-step-ms 25 --time-scale 4
"""

from __future__ import annotations

import argparse

from gateway.config import AppConfig
from replica.engine_protocol import ENGINE_NAMES


def add_fleet_args(p: argparse.ArgumentParser) -> None:
    d = AppConfig()
    g = p.add_argument_group("fleet", "many gateways; simulated-compute replicas (--engine sim)")
    g.add_argument("--gateways", type=int, default=d.gateways, help="ingress replicas, each with its own router")
    g.add_argument("--engine", choices=list(ENGINE_NAMES), default=d.engine,
                   help="model: our engine; sim: real cache, scheduler and publisher, modelled compute time, no torch; "
                        "vllm: vLLM's engine in each replica (docs/vllm.md)")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="sequences running at once per replica")
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="tokens per engine step (the prefill chunk, decodes included)")
    g.add_argument("--time-scale", type=float, default=d.time_scale,
                   help="sim: modelled times are divided by this in wall time")
    g.add_argument("--sim-prefill-tokens-per-s", type=float, default=None,
                   help="sim: uncached prompt tokens one replica computes per modelled second")
    g.add_argument("--sim-decode-step-ms", type=float, default=None,
                   help="sim: fixed cost of one decode step, modelled milliseconds")
    g.add_argument("--sim-service", action="append", default=[], metavar="KEY=VALUE",
                   help="sim: any ServiceModel field, e.g. decode_s_per_seq=0.0005 (repeatable)")
    g.add_argument("--sim-replica-cpus", type=float, default=d.sim_replica_num_cpus,
                   help="sim: CPU reserved per replica")


def fleet_fields(args: argparse.Namespace) -> dict:
    """AppConfig fields from the flags above."""
    service: dict[str, float] = {}
    for item in args.sim_service:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--sim-service takes KEY=VALUE, got {item!r}")
        service[key.replace("-", "_")] = float(value)
    if args.sim_prefill_tokens_per_s is not None:
        if args.sim_prefill_tokens_per_s <= 0:
            raise SystemExit("--sim-prefill-tokens-per-s must be positive")
        service["prefill_s_per_token"] = 1.0 / args.sim_prefill_tokens_per_s
    if args.sim_decode_step_ms is not None:
        service["decode_step_s"] = args.sim_decode_step_ms / 1000.0
    return {
        "gateways": args.gateways, "engine": args.engine, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens, "time_scale": args.time_scale,
        "sim_service": service, "sim_replica_num_cpus": args.sim_replica_cpus,
    }
