"""A step's model inputs as row-indexed buffers kept from step to step (a persistent batch).

Each running request holds one row of `block_table` from its first step until it leaves; a step
writes only what changed since the one before (the blocks a request gained, the whole table of a
request that is new or was re-admitted after a preemption) and derives the decode rows' token
ids, positions, pool slots and context lengths with array operations over their rows, as vLLM
v1's InputBatch and `BlockTable.compute_slot_mapping` do. Every buffer has a fixed size, allocated
once: on a GPU the host side is pinned and copied to the device without blocking, so a decode
step's inputs keep their addresses from step to step (what a captured CUDA graph replays).

The host side is written through numpy views: a row update or a gather costs a few hundred
nanoseconds there, where indexing a torch tensor from Python costs microseconds.

Reuse is safe because the engine reads one host copy of each step's result (the sampled ids)
before it prepares the next step: every copy out of these buffers has finished by then.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

from replica.core.scheduler import ScheduledChunk


class StagedBuffer:
    """A fixed-size int64 buffer on the host (numpy view `np`) and its mirror on the model's
    device; on CPU they are one tensor and nothing is copied. mirror=False: host only."""

    @torch.inference_mode()  # inference tensors, as the forward's own: a compiled graph's guards
    def __init__(self, shape: tuple[int, ...], device: torch.device, mirror: bool = True) -> None:  # tell them apart
        on_gpu = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=torch.int64, pin_memory=on_gpu)
        self.np = self.host.numpy()
        self.device = torch.zeros(shape, dtype=torch.int64, device=device) if on_gpu and mirror else self.host

    def to_device(self, n: int) -> torch.Tensor:
        """The first n entries (rows) on the device: a view that keeps its address across steps
        (under inference mode, as StepInputs.prepare runs: the buffers are inference tensors)."""
        if self.device is not self.host:
            self.device[:n].copy_(self.host[:n], non_blocking=True)
        return self.device[:n]


@dataclass
class _Row:
    """What a row was last written from: the request's block list object (the block manager
    replaces it on admission and on free, and only appends to it in between) and how many of its
    entries the row holds."""

    block_ids: list[int]
    written: int
    preemptions: int


class InputBatch:
    """Rows for up to `max_rows` running requests and one step of at most `max_tokens` tokens."""

    def __init__(self, max_rows: int, max_blocks: int, max_tokens: int, block_size: int, device: torch.device) -> None:
        self.max_rows, self.max_blocks, self.block_size = max_rows, max_blocks, block_size
        # read in place by the C kernel on CPU; a GPU reads decode_tables, gathered from it
        self.block_table = StagedBuffer((max_rows, max_blocks), device, mirror=False)
        self.input_ids = StagedBuffer((max_tokens,), device)
        self.positions = StagedBuffer((max_tokens,), device)
        self.slot_mapping = StagedBuffer((max_tokens,), device)
        self.sample_rows = StagedBuffer((max_tokens,), device)
        self.decode_lens = StagedBuffer((max_rows,), device)
        self.decode_offsets = StagedBuffer((max_rows + 1,), device)  # where each decode's row starts in block_table
        self.decode_tables = StagedBuffer((max_rows, max_blocks), device)  # decode rows' tables, in step order
        self._rows: dict[str, int] = {}  # request id -> row
        self._state: list[_Row | None] = [None] * max_rows
        self._free = list(range(max_rows))  # a heap: the lowest free row first, so rows stay dense

    def __len__(self) -> int:
        return len(self._rows)

    def row_of(self, request_id: str) -> int | None:
        return self._rows.get(request_id)

    def release(self, request_id: str) -> None:
        """The request left (finished or aborted): its row is free for the next one."""
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._state[row] = None
            heapq.heappush(self._free, row)

    def rows_for(self, chunks: list[ScheduledChunk]) -> np.ndarray:
        """Each chunk's row, brought up to date with its request's block table."""
        rows = np.empty(len(chunks), dtype=np.int64)
        for i, c in enumerate(chunks):
            rows[i] = self._sync(c.seq, chunks)
        return rows

    def _sync(self, seq, step: list[ScheduledChunk]) -> int:
        row = self._rows.get(seq.request_id)
        if row is None:
            row = self._new_row(seq.request_id, step)
        state = self._state[row]
        ids = seq.table.block_ids
        if state is None or state.block_ids is not ids or state.preemptions != seq.num_preemptions or len(ids) < state.written:
            state = self._state[row] = _Row(ids, 0, seq.num_preemptions)  # new, or re-admitted: rewrite
        n = len(ids)
        if n > state.written:
            if n > self.max_blocks:
                raise ValueError(f"a request holds {n} blocks, past the batch's {self.max_blocks} per row")
            self.block_table.np[row, state.written : n] = ids[state.written :]
            state.written = n
        return row

    def _new_row(self, request_id: str, step: list[ScheduledChunk]) -> int:
        if not self._free:
            self._reclaim(step)
        row = heapq.heappop(self._free)
        self._rows[request_id] = row
        return row

    def _reclaim(self, step: list[ScheduledChunk]) -> None:
        """Free the rows of requests not in this step: preempted requests keep their rows while
        they wait, so rows can run out although the step itself fits (it has at most max_rows
        requests); a reclaimed request is written afresh when it runs again."""
        keep = {c.seq.request_id for c in step}
        for request_id in [r for r in self._rows if r not in keep]:
            self.release(request_id)
        if not self._free:
            raise RuntimeError(f"a step of more than {self.max_rows} requests")

    def slots(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Pool slot of each (row, position): its block's id x block size + the offset in it."""
        bs = self.block_size
        return self.block_table.np[rows, positions // bs] * bs + positions % bs
