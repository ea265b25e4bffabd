"""One definition of "a Mooncake trace row, scaled to a block size", for the live replay and the
simulator alike.

The trace's hash ids stand for 512-token blocks. A replay at block size `bs` maps each hash id to
one block of `bs` synthetic token ids (`block_tokens`, deterministic from the id, so equal ids
give equal tokens and, the ids being chained, equal prefixes give equal block hashes), then adds
one request-unique trailing token (`trailing_token`) so every full block of the prompt can be a
cache hit (an engine always computes at least one prompt token). `scale_rows` turns rows into
`SimRequest`s carrying exactly those lengths: the simulator replays them with hash ids as block
keys, the live replay sends `prompt_tokens(...)` of the same objects. `scale_service` converts the
service model, stated for 512-token blocks, to the same block size (per-block costs unchanged)
and optionally to a wall-clock time scale.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

from router.costs.service import ServiceModel
from router.costs.transfer_model import TransferModel
from router.sim.workload import SimRequest

TRACE_BLOCK_TOKENS = 512  # Mooncake: one hash id stands for 512 prompt tokens
TOKEN_ID_RANGE = (1000, 40000)  # ordinary BPE ids of the default vocabulary, clear of special ids


def block_tokens(hash_id: int, block_size: int, seed: int = 0) -> list[int]:
    """The synthetic token block of one trace hash id: a pure function of (seed, id, size)."""
    rng = random.Random(f"{seed}:block:{hash_id}")
    lo, hi = TOKEN_ID_RANGE
    return [rng.randrange(lo, hi) for _ in range(block_size)]


def trailing_token(index: int) -> int:
    """A token that differs between neighbouring requests (the row index spread over the range)."""
    lo, hi = TOKEN_ID_RANGE
    return lo + (index * 7919) % (hi - lo)


def prompt_tokens(req: SimRequest, index: int, block_size: int, seed: int = 0) -> list[int]:
    """The prompt the live replay sends for `req`: one block per hash id, then one unique token.
    Under an adapter, the blocks are its base keys' (the same tokens under two adapters)."""
    out: list[int] = []
    for h in req.base_hashes or req.hashes:
        out.extend(block_tokens(h, block_size, seed))
    out.append(trailing_token(index))
    return out


def load_rows(path: str | Path, start: int = 0, count: int | None = None) -> list[dict]:
    """A contiguous slice of trace rows (JSON lines), in file order."""
    rows: list[dict] = []
    with Path(path).open() as f:
        for i, line in enumerate(f):
            if i < start:
                continue
            if count is not None and len(rows) >= count:
                break
            if line.strip():
                rows.append(json.loads(line))
    return rows


def scale_rows(rows: list[dict], block_size: int, max_output: int) -> list[SimRequest]:
    """Rows -> requests at `block_size` tokens per hash id: input = blocks * bs + 1 (the trailing
    token), output = the trace's output length capped at `max_output` (not scaled: a decode step
    costs the same at any block size, see `scale_service`); arrival in seconds from the first
    row (the trace's own clock; time scales apply later)."""
    if block_size <= 0 or max_output <= 0:
        raise ValueError("block_size and max_output must be positive")
    if not rows:
        return []
    t0 = float(rows[0]["timestamp"])
    out = []
    for r in rows:
        ids = [int(h) for h in r["hash_ids"]]
        output = min(max(1, int(r.get("output_length", 1))), max_output)
        out.append(SimRequest((float(r["timestamp"]) - t0) / 1000.0, ids, len(ids) * block_size + 1, output))
    return out


def request_blocks(req: SimRequest, block_size: int) -> int:
    """Blocks a replica needs for the whole request (prompt plus its capped output)."""
    return -(-(req.input_tokens + req.output_tokens) // block_size)


def split_fitting(requests: list[SimRequest], capacity_blocks: int, block_size: int,
                  max_model_len: int | None = None) -> tuple[list[SimRequest], int]:
    """Drops requests no replica could hold (the gateway refuses them with a 400, the simulator
    rejects them); both sides then replay the same kept rows. Returns (kept, dropped)."""
    kept = [
        r for r in requests
        if request_blocks(r, block_size) <= capacity_blocks
        and (max_model_len is None or r.input_tokens + r.output_tokens <= max_model_len)
    ]
    return kept, len(requests) - len(kept)


def scale_service(service: ServiceModel, block_size: int, time_scale: float = 1.0) -> ServiceModel:
    """The service model for `block_size`-token blocks: the per-token prefill cost times 512/bs
    and the prefill chunk times bs/512, so a block costs what it did at 512 and a prefill takes
    as many steps; decode steps (one token per sequence at any block size) are unchanged. Then
    every duration divided by `time_scale` (< 1 runs the same system slower in wall time)."""
    k = TRACE_BLOCK_TOKENS / block_size
    per_block = dataclasses.replace(
        service,
        prefill_s_per_token=service.prefill_s_per_token * k,
        chunk_tokens=max(1, round(service.chunk_tokens / k)),
    )
    return per_block.scaled(time_scale) if time_scale != 1.0 else per_block


def scale_transfer(transfer: TransferModel, block_size: int) -> TransferModel:
    """The pull model for `block_size`-token blocks, as `scale_service` does for compute: K/V
    bytes per token times 512/bs and the prefill rate divided by it, so a block moves and
    computes in the time a 512-token block did (link speed and fixed cost unchanged)."""
    k = TRACE_BLOCK_TOKENS / block_size
    return dataclasses.replace(transfer, kv_bytes_per_token=transfer.kv_bytes_per_token * k,
                               prefill_tokens_per_s=transfer.prefill_tokens_per_s / k)
