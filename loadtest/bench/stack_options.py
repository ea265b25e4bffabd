"""`--config KEY=JSON`: the one option every live benchmark takes to set an AppConfig field of the
stack it starts (serving, noisy-neighbour, overload), parsed one way for all of them."""

from __future__ import annotations

import argparse
import json
from typing import Any


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
