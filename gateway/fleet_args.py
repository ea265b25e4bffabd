"""Shorthands of `prefixgate serve` for simulated-compute fleets, on top of the flags generated
from AppConfig (gateway/config_cli.py: --engine sim, --gateways, --time-scale, --sim-service
KEY=VALUE, ... are those):

    prefixgate serve --engine sim --replicas 32 --gateways 2 --num-blocks 256 \\
        --sim-prefill-tokens-per-s 7000 --sim-decode-step-ms 25 --time-scale 4
"""

from __future__ import annotations

import argparse


def add_fleet_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sim shorthands", "ServiceModel fields in the units people quote")
    g.add_argument("--sim-prefill-tokens-per-s", type=float, default=None,
                   help="sim: uncached prompt tokens one replica computes per modelled second (prefill_s_per_token)")
    g.add_argument("--sim-decode-step-ms", type=float, default=None,
                   help="sim: fixed cost of one decode step, modelled milliseconds (decode_step_s)")


def sim_service_overrides(args: argparse.Namespace) -> dict[str, float]:
    """The ServiceModel fields the shorthands above set."""
    service: dict[str, float] = {}
    if args.sim_prefill_tokens_per_s is not None:
        if args.sim_prefill_tokens_per_s <= 0:
            raise SystemExit("--sim-prefill-tokens-per-s must be positive")
        service["prefill_s_per_token"] = 1.0 / args.sim_prefill_tokens_per_s
    if args.sim_decode_step_ms is not None:
        service["decode_step_s"] = args.sim_decode_step_ms / 1000.0
    return service
