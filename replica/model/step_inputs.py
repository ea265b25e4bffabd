"""One step's model inputs and attention metadata, built from the scheduler's chunks over the
persistent batch (replica/model/input_batch.py).

Single-token chunks at the end of a sequence (decodes) are laid out first, then prefill chunks:
prompts with nothing cached first, by length, so that those of one length form one segment
attended as a batch (PrefillSegment.count).
A decode row's token id, position, pool slot and context length come from its row of the
persistent block table with array operations; a prefill chunk's from its row the same way, one
chunk at a time. Which form of the decodes' block tables a step carries follows the attention
that reads it:
- the C decode kernel (replica/kernels/cpu_attention.py) reads the persistent table in place,
  one offset per row; rows whose contexts start in the same block are laid out next to each
  other (shortest first), since the kernel reads blocks adjacent rows share once;
- the Triton kernels read every decode row's whole table, gathered in step order;
- the torch path attends by cascades (rows sharing a physical prefix, DecodeCascade) and
  length groups (DecodeGroup), built here from the requests' block lists.
"""

from __future__ import annotations

import numpy as np
import torch

from replica.core.scheduler import ScheduledChunk
from replica.kernels import attention
from replica.kernels.attention_metadata import (
    AttentionMetadata,
    DecodeCascade,
    DecodeGroup,
    KVPool,
    PrefillSegment,
)
from replica.model.input_batch import InputBatch

MIN_CASCADE_SAVED_BLOCKS = 4  # below this, the cascade's extra small operations cost more than the reads they save


class StepInputs:
    """Builds each step's (input_ids [1, T], positions [1, T], metadata, sample_rows) over one pool."""

    def __init__(self, pool: KVPool, block_size: int, device: torch.device, *, max_rows: int, max_tokens: int,
                 max_blocks: int, cpu_decode: bool = False) -> None:
        self.pool, self.block_size, self.device = pool, block_size, device
        self.cpu_decode = cpu_decode  # the C decode kernel attends decodes (while the default backend runs)
        self.batch = InputBatch(max_rows, max_blocks, max_tokens, block_size, device)

    def release(self, request_id: str) -> None:
        self.batch.release(request_id)

    @torch.inference_mode()
    def prepare(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flatten the step's chunks into model inputs and attention metadata; `chunks` is
        reordered in place to the order the rows were laid out (decodes first)."""
        batch, bs = self.batch, self.block_size
        # a one-token chunk in the middle of a prompt (the step's token budget ran out) is a
        # prefill chunk that samples nothing
        decodes = [c for c in chunks if _is_decode(c)]
        # prompts with nothing cached first, by length: those of one length lie side by side and
        # attend as one batch (a segment's count)
        prefills = sorted((c for c in chunks if not _is_decode(c)), key=lambda c: (c.start != 0, c.end - c.start))
        use_kernel = self.cpu_decode and attention.default_backend()
        cascades = attention.default_backend() and not use_kernel
        clusters = _prefix_clusters(decodes, bs) if cascades else []
        if cascades:
            decodes = [c for rows, _ in clusters for c in rows]
        nd = len(decodes)
        total = nd + sum(c.end - c.start for c in prefills)
        if total > batch.input_ids.np.shape[0] or len(chunks) > batch.max_rows:
            raise ValueError(f"a step of {total} tokens and {len(chunks)} requests, past the batch's "
                             f"{batch.input_ids.np.shape[0]} tokens and {batch.max_rows} requests")
        rows = batch.rows_for(decodes + prefills)
        d_rows = rows[:nd]
        ends = np.fromiter((c.end for c in decodes), np.int64, nd)
        if use_kernel and nd > 1:
            order = np.lexsort((ends, batch.block_table.np[d_rows, 0]))
            decodes = [decodes[i] for i in order]
            d_rows, ends = d_rows[order], ends[order]
        chunks[:] = decodes + prefills

        ids, positions, slots, sample = (batch.input_ids.np, batch.positions.np, batch.slot_mapping.np,
                                         batch.sample_rows.np)
        ids[:nd] = np.fromiter((c.seq.token_ids[c.start] for c in decodes), np.int64, nd)
        positions[:nd] = ends - 1
        slots[:nd] = batch.slots(d_rows, ends - 1)
        sample[:nd] = np.arange(nd)  # a decode always reaches its last token
        t, ns = nd, nd
        segments: list[PrefillSegment] = []
        for c, row in zip(prefills, rows[nd:].tolist(), strict=True):
            span = np.arange(c.start, c.end)
            q_start, t = t, t + len(span)
            ids[q_start:t] = c.seq.token_ids[c.start : c.end]
            positions[q_start:t] = span
            slots[q_start:t] = batch.slots(row, span)
            if c.samples:
                sample[ns] = t - 1
                ns += 1
            last = segments[-1] if segments else None
            if c.start == 0 and last is not None and last.kv_slots is None and last.q_end - last.q_start == \
                    last.count * (t - q_start):
                last.q_end, last.count = t, last.count + 1  # one more prompt of that length
            else:
                segments.append(self._segment(c, row, q_start, t))

        max_context = max(int(ends.max()) if nd else 0, max((c.end for c in prefills), default=0))
        meta = AttentionMetadata(pool=self.pool, slot_mapping=batch.slot_mapping.to_device(t), prefills=segments,
                                 block_size=bs, num_decodes=nd, max_context=max_context)
        if nd:
            batch.decode_lens.np[:nd] = ends
            meta.decode_lens = batch.decode_lens.to_device(nd)
            if use_kernel:
                self._kernel_tables(meta, d_rows)
            else:
                self._gathered_tables(meta, d_rows, ends)
        first = 0
        for c_rows, shared in clusters:
            meta.decode_cascades.append(self._cascade(c_rows, shared, first))
            first += len(c_rows)
        input_ids = batch.input_ids.to_device(t)[None]
        return input_ids, batch.positions.to_device(t)[None], meta, batch.sample_rows.to_device(ns)

    # ---- the decodes' block tables, in each attention's form ----------------------------------
    def _kernel_tables(self, meta: AttentionMetadata, d_rows: np.ndarray) -> None:
        """The C kernel's form: the persistent table read in place, each row's start in it."""
        batch = self.batch
        nd, width = len(d_rows), batch.max_blocks
        offsets = batch.decode_offsets.np
        offsets[:nd] = d_rows * width
        offsets[nd] = batch.max_rows * width  # the table's end: every row's table lies within [offset, end)
        meta.decode_tables = batch.block_table.device.view(-1)
        meta.decode_offsets = batch.decode_offsets.to_device(nd + 1)

    def _gathered_tables(self, meta: AttentionMetadata, d_rows: np.ndarray, ends: np.ndarray) -> None:
        """Every decode row's blocks up to the longest context, in step order (Triton's form)."""
        batch = self.batch
        nd, width = len(d_rows), -(-int(ends.max()) // self.block_size)
        flat = batch.decode_tables.np.reshape(-1)
        flat[: nd * width].reshape(nd, width)[:] = batch.block_table.np[d_rows, :width]
        meta.decode_block_table = batch.decode_tables.device.view(-1)[: nd * width].view(nd, width)
        if batch.decode_tables.device is not batch.decode_tables.host:
            meta.decode_block_table.copy_(batch.decode_tables.host.view(-1)[: nd * width].view(nd, width),
                                          non_blocking=True)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor built for this step on the model's device, without waiting for the device:
        a blocking copy would wait for everything queued before it (a host sync per call)."""
        return t.to(self.device, non_blocking=True)

    # ---- prefill chunks -------------------------------------------------------------------------
    def _segment(self, c: ScheduledChunk, row: int, q_start: int, q_end: int) -> PrefillSegment:
        """A chunk with nothing before it attends over its own new K/V; one after a cached or
        earlier chunk attends over its whole context in the pool, offset-causally."""
        if c.start == 0:
            return PrefillSegment(q_start, q_end, None, None)
        kv_slots = torch.from_numpy(self.batch.slots(row, np.arange(c.end)))
        mask = torch.arange(c.end)[None, :] <= torch.arange(c.start, c.end)[:, None]
        return PrefillSegment(q_start, q_end, self._to_device(kv_slots), self._to_device(mask))

    # ---- the torch path's cascades and groups -----------------------------------------------------
    def _cascade(self, rows: list[ScheduledChunk], shared: int, first_row: int) -> DecodeCascade:
        bs = self.block_size
        prefix = None
        if shared:
            prefix = self._to_device(torch.tensor(rows[0].seq.table.block_ids[:shared], dtype=torch.long))
        cascade = DecodeCascade(first_row, first_row + len(rows), prefix)
        lengths = [c.end - shared * bs for c in rows]  # what each row attends beyond the prefix
        for start, end in attention.plan_decode_groups(lengths):
            cascade.groups.append(self._decode_group(rows, lengths, start, end, shared, first_row))
        return cascade

    def _decode_group(
        self, decodes: list[ScheduledChunk], lengths: list[int], start: int, end: int, skip: int, offset: int
    ) -> DecodeGroup:
        """Rows [start, end) of `decodes` (laid out from row `offset`): block tables past the
        `skip` shared blocks (padded with block 0) and, if lengths differ, the valid-slot mask."""
        bs = self.block_size
        width = -(-lengths[end - 1] // bs)
        rows = []
        for c in decodes[start:end]:
            table = c.seq.table.block_ids[skip : skip + width]
            rows.append(table + [0] * (width - len(table)))
        tables = torch.tensor(rows, dtype=torch.long)
        mask = None
        if any(n != width * bs for n in lengths[start:end]):
            valid = torch.arange(width * bs)[None, :] < torch.tensor(lengths[start:end])[:, None]
            mask = self._to_device(valid[None, :, None, :])
        return DecodeGroup(offset + start, offset + end, self._to_device(tables), mask)


def _is_decode(c: ScheduledChunk) -> bool:
    return c.end - c.start == 1 and c.start > 0 and c.samples


def _prefix_clusters(decodes: list[ScheduledChunk], block_size: int) -> list[tuple[list[ScheduledChunk], int]]:
    """Decode rows clustered by the physical blocks their contexts start with, each with how
    many leading blocks all its rows share; rows that share nothing worth a cascade come last,
    together (shared 0). Each cluster is sorted by context length.

    Requests admitted in the same step compute the same system prompt into different blocks,
    so a batch can hold several copies of one prefix: each copy gets its own cascade.
    """
    by_first: dict[int, list[ScheduledChunk]] = {}
    alone: list[ScheduledChunk] = []
    for c in decodes:
        if c.end - 1 >= block_size:  # a full block before the current token
            by_first.setdefault(c.seq.table.block_ids[0], []).append(c)
        else:
            alone.append(c)
    clusters: list[tuple[list[ScheduledChunk], int]] = []
    for rows in by_first.values():
        shared = _common_prefix_blocks(rows, block_size)
        if shared * (len(rows) - 1) >= MIN_CASCADE_SAVED_BLOCKS:
            clusters.append((sorted(rows, key=lambda c: c.end), shared))
        else:
            alone.extend(rows)
    if alone:
        clusters.append((sorted(alone, key=lambda c: c.end), 0))
    return clusters


def _common_prefix_blocks(decodes: list[ScheduledChunk], block_size: int) -> int:
    """How many leading blocks every decode's table shares (the same physical blocks: a prefix
    hit). Each row's current token is never in a shared block, so its suffix is never empty."""
    if len(decodes) < 2:
        return 0
    first = decodes[0].seq.table.block_ids
    n = min((c.end - 1) // block_size for c in decodes)
    for c in decodes[1:]:
        table = c.seq.table.block_ids
        i = 0
        while i < n and table[i] == first[i]:
            i += 1
        n = i
        if n == 0:
            break
    return n
