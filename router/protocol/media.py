"""Where a cached block lives on its replica (its medium), and how that travels in Redis.

A replica keeps each block in one tier at a time: the device pool (what attention reads), the
host tier (host memory, pinned on a GPU) or the disk tier (a bounded local file). A block in a
lower tier is still a prefix hit there: it is copied back into the pool before the prefill
instead of being recomputed (replica/kvcache/kv_tiers.py), at a cost the router prices.

In the inverted index ({p:bK}:blk:{hash}) a holder is its replica id for the device pool and
"replica|medium" for a lower tier; the per-replica set ({p}:blocks:{rid}) holds "hash" or
"hash|medium" the same way. So an index written before tiers existed reads as all-device, and
a replica counts once per block (it holds it in exactly one tier).

vLLM names media in its KV events ("GPU", "CPU"; LMCache and others use lower case and their
own names for disk): `parse_medium` maps them onto ours.
"""

from __future__ import annotations

DEVICE = "device"
HOST = "host"
DISK = "disk"
MEDIA = (DEVICE, HOST, DISK)  # fastest first
LOWER_MEDIA = (HOST, DISK)

SEPARATOR = "|"

_ALIASES = {
    None: DEVICE, "": DEVICE, "gpu": DEVICE, "cuda": DEVICE, "device": DEVICE, "hbm": DEVICE, "xpu": DEVICE,
    "cpu": HOST, "host": HOST, "dram": HOST, "localcpubackend": HOST, "pinned": HOST,
    "disk": DISK, "ssd": DISK, "nvme": DISK, "localdiskbackend": DISK, "file": DISK,
}


class UnknownMedium(ValueError):
    """A medium name no tier of ours corresponds to."""


def parse_medium(raw: str | None) -> str:
    """Our medium for a name as vLLM, LMCache or our own replicas write it."""
    key = raw.lower() if isinstance(raw, str) else raw
    try:
        return _ALIASES[key]
    except KeyError:
        raise UnknownMedium(f"unknown K/V medium {raw!r} (known: {sorted(k for k in _ALIASES if k)})") from None


def check_replica_id(replica_id: str) -> str:
    """Replica ids are index members: they must not contain the medium separator."""
    if not replica_id or SEPARATOR in replica_id:
        raise ValueError(f"replica id {replica_id!r} must be non-empty and must not contain {SEPARATOR!r}")
    return replica_id


def member(replica_id: str, medium: str = DEVICE) -> str:
    """The inverted-index member saying `replica_id` holds a block in `medium`."""
    return replica_id if medium == DEVICE else f"{replica_id}{SEPARATOR}{medium}"


def split_member(value: str) -> tuple[str, str]:
    """(replica id, medium) of an inverted-index member."""
    rid, sep, medium = value.partition(SEPARATOR)
    return (rid, medium) if sep and medium in LOWER_MEDIA else (value, DEVICE)


def entry(block_hash: int, medium: str = DEVICE) -> str:
    """A replica's own block-set entry for a block it holds in `medium`."""
    return str(block_hash) if medium == DEVICE else f"{block_hash}{SEPARATOR}{medium}"


def split_entry(value: str | bytes) -> tuple[int, str]:
    """(block hash, medium) of a replica's block-set entry."""
    text = value.decode() if isinstance(value, bytes) else value
    h, sep, medium = text.partition(SEPARATOR)
    return int(h), (medium if sep and medium in LOWER_MEDIA else DEVICE)
