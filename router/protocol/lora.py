"""LoRA adapters as every process names them: the `NAME=PATH` spec, the content digest, and
the identity that enters block hashes (router.protocol.hashing.chain_seed).

Torch-free on purpose: the gateway and the router hash prompts for an adapter without loading
it, and a replica computes the same identity from the same files, so the router's lookups and
the replica's cache keys agree. vLLM keys an adapter's K/V by name and path only; the identity
here also carries a digest of the files, so a different adapter reloaded under the same name
never meets the old one's K/V.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import msgspec

# LoRA adapters a replica keeps in host memory where its config sets none (vLLM's max_cpu_loras;
# the rest are read from disk when a request needs them, least recently used out): the engines'
# default and the simulator's
MAX_CPU_LORAS = 8

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # what peft saves, in its preference order
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")  # what a request's `model` may name


class AdapterError(ValueError):
    """An adapter that cannot be served: a missing or malformed directory, a bad name."""


class AdapterRef(msgspec.Struct, frozen=True):
    """One adapter as configured: its served name, its directory, the digest of its files."""

    name: str
    path: str
    digest: str

    @property
    def identity(self) -> str:
        """What block hashes are rooted in: the name and the content digest."""
        return f"{self.name}@{self.digest}"


def check_name(name: str) -> str:
    if not NAME_PATTERN.match(name):
        raise AdapterError(f"adapter name {name!r} must match {NAME_PATTERN.pattern}")
    return name


def weights_file(path: str | Path) -> Path:
    """The adapter's weights file (safetensors preferred, as peft saves)."""
    for name in ADAPTER_WEIGHTS:
        f = Path(path) / name
        if f.is_file():
            return f
    raise AdapterError(f"{path}: no {' or '.join(ADAPTER_WEIGHTS)} (not a PEFT adapter directory)")


def read_config(path: str | Path) -> dict:
    """The adapter's adapter_config.json, checked to be a LoRA config."""
    f = Path(path) / ADAPTER_CONFIG
    if not Path(path).is_dir():
        raise AdapterError(f"{path}: adapter directory does not exist")
    if not f.is_file():
        raise AdapterError(f"{f}: missing (not a PEFT adapter directory)")
    try:
        config = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{f}: not valid JSON ({e})") from None
    if not isinstance(config, dict) or str(config.get("peft_type", "")).upper() != "LORA":
        raise AdapterError(f"{f}: peft_type must be LORA, got {config.get('peft_type') if isinstance(config, dict) else config!r}")
    return config


def digest(path: str | Path) -> str:
    """sha256 of the config and the weights (first 16 hex digits): equal files, equal digest."""
    read_config(path)
    h = hashlib.sha256()
    for f in (Path(path) / ADAPTER_CONFIG, weights_file(path)):
        h.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            for block in iter(lambda fh=fh: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def adapter_ref(name: str, path: str | Path) -> AdapterRef:
    """An adapter directory, checked enough to name it (peft reads it fully on the replica)."""
    check_name(name)
    return AdapterRef(name=name, path=str(Path(path).resolve()), digest=digest(path))


def parse_spec(spec: str) -> tuple[str, str]:
    """`NAME=PATH` (the `--lora` flag's form) as (name, path)."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise AdapterError(f"adapter {spec!r}: expected NAME=PATH")
    return check_name(name), path
