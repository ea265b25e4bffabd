"""The options every live benchmark (serving, noisy-neighbour, overload) takes for the stack it
starts, parsed one way for all of them: `--config KEY=JSON` sets an AppConfig field, `--ingress`
the HTTP front (gateway/ingress.py)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from gateway.ingress import DEFAULT_INGRESS, INGRESSES


def _item(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=JSON, got {text!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{key}: the value is not JSON ({e})") from None


def add_config_option(p: argparse.ArgumentParser, example: str) -> None:
    """`--config KEY=JSON` (repeatable), e.g. `example`; `config_overrides` reads them."""
    p.add_argument("--config", action="append", default=[], type=_item, metavar="KEY=JSON",
                   help=f"an AppConfig field for the stack, e.g. {example} (repeatable)")


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return dict(args.config)


def add_ingress_option(p: argparse.ArgumentParser, several: bool = False) -> None:
    """`--ingress proxy|haproxy`; with `several`, a list of them, each measured on its own stack."""
    if several:
        p.add_argument("--ingress", nargs="+", choices=INGRESSES, default=[DEFAULT_INGRESS],
                       help="the HTTP front(s) to measure (gateway/ingress.py), each on a fresh stack in a process of its own")
    else:
        p.add_argument("--ingress", choices=INGRESSES, default=DEFAULT_INGRESS,
                       help="the HTTP front of the stack (gateway/ingress.py)")
