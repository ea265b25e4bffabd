"""`prefixgate serve` flags generated from AppConfig's fields: one definition, its default and
its help, for the CLI and for Serve config files alike (gateway/config.py).

A field `foo_bar` is the flag `--foo-bar` (or its `flag` metadata). Scalars parse as their
type; `X | None` fields also take `none`; dict fields take a JSON object or KEY=VALUE
(repeatable, values read as JSON where they parse, else as strings). A flag not given leaves
the field at its default.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from dataclasses import fields
from typing import Any

from gateway.config import AppConfig


def _flag(f) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _base_type(annotation: Any) -> tuple[type, bool]:
    """(the type a value parses as, whether None is allowed) of a field's annotation."""
    hint = eval(annotation, vars(typing)) if isinstance(annotation, str) else annotation  # noqa: S307 (our own annotations)
    args = typing.get_args(hint)
    optional = type(None) in args
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in args if a is not type(None))
    return (typing.get_origin(hint) or hint), optional


def _scalar(kind: type, optional: bool):
    def parse(text: str):
        if optional and text.lower() == "none":
            return None
        if kind is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
            return text.lower() in ("true", "1")
        return kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its error
    return parse


def _dict_item(text: str) -> dict:
    text = text.strip()
    if text.startswith("{"):
        value = json.loads(text)
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError("expected a JSON object")
        return value
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE or a JSON object, got {text!r}")
    try:
        return {key: json.loads(raw)}
    except json.JSONDecodeError:
        return {key: raw}


def add_config_args(p: argparse.ArgumentParser) -> None:
    """One flag per AppConfig field (fields marked cli="none" excepted)."""
    defaults = AppConfig()
    for f in fields(AppConfig):
        cli = f.metadata.get("cli", "auto")
        if cli == "none":
            continue
        kind, optional = _base_type(f.type)
        default = getattr(defaults, f.name)
        text = f.metadata.get("help", "")
        if cli == "path-or-models":  # PATH once, or NAME=PATH per model (config_values)
            p.add_argument(_flag(f), dest=f.name, action="append", metavar="PATH|NAME=PATH", default=argparse.SUPPRESS,
                           help=f"{text} (repeatable)")
        elif cli == "json-file":
            p.add_argument(_flag(f), dest=f.name, metavar="FILE", default=argparse.SUPPRESS, help=text)
        elif kind is dict:
            p.add_argument(_flag(f), dest=f.name, type=_dict_item, action="append", metavar="KEY=VALUE|JSON",
                           default=argparse.SUPPRESS, help=f"{text} (repeatable)")
        else:
            shown = "" if default is None else f" (default: {default})"
            choices = f.metadata.get("choices")
            p.add_argument(_flag(f), dest=f.name, type=_scalar(kind, optional), default=argparse.SUPPRESS,
                           choices=choices, metavar="NAME" if choices else kind.__name__.upper(), help=text + shown)


def _models(values: list[str]) -> dict[str, Any]:
    """`--model PATH` (one model, as always) or `--model NAME=PATH` per model (`models`)."""
    if len(values) == 1 and "=" not in values[0]:
        return {"model": values[0]}
    models = []
    for text in values:
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--model: with several models each is NAME=PATH, got {text!r}")
        models.append({"name": name, "path": path})
    return {"models": models}


def config_values(args: argparse.Namespace) -> dict[str, Any]:
    """The AppConfig fields the command line set (the flags above that were given)."""
    out: dict[str, Any] = {}
    for f in fields(AppConfig):
        if not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if f.metadata.get("cli") == "path-or-models":
            out.update(_models(value))
            continue
        if f.metadata.get("cli") == "json-file":
            flag = "--" + f.name.replace("_", "-")
            try:
                with open(value) as fh:
                    value = json.load(fh)
            except OSError as e:
                raise ValueError(f"{flag} {value}: cannot read it ({e.strerror})") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"{flag} {value}: not JSON ({e})") from None
        elif isinstance(value, list):  # a dict field given as repeated items
            merged: dict = {}
            for item in value:
                merged.update(item)
            if not f.metadata.get("raw_keys"):  # field names: decode-step-s means decode_step_s
                merged = {k.replace("-", "_"): v for k, v in merged.items()}
            value = merged
        out[f.name] = value
    return out
