"""Loads a transformers model with paged attention and runs one batched step over the pool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from replica.core.scheduler import ScheduledChunk
from replica.kernels import attention, cpu_attention
from replica.kernels.attention_metadata import (
    AttentionMetadata,
    DecodeCascade,
    DecodeGroup,
    KVPool,
    PrefillSegment,
)
from replica.model import fused, lora, packed_linear

if TYPE_CHECKING:
    from replica.model.compiled_step import CompiledForward, CompileStats


@dataclass
class ModelShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    num_heads: int  # query heads

    @classmethod
    def from_config(cls, config) -> ModelShape:
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            max_position_embeddings=getattr(config, "max_position_embeddings", 2048),
            num_heads=config.num_attention_heads,
        )

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * itemsize


WARM_UP_SIZES = [2, 16]  # the compiled graph's first run, then a second size that must reuse it


def default_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


class ModelRunner:
    cpu_decode = False  # no C decode kernel unless __init__ finds one that takes the pool (triton_check builds
    # runners without __init__ and reads this default)

    def __init__(
        self, model_path: str, *, block_size: int, num_blocks: int, device: torch.device, dtype: torch.dtype,
        max_model_len: int | None = None, compile: bool = False, lora_slots: int = 0, max_lora_rank: int = 16,
    ) -> None:
        """Raises attention.UnsupportedModelError for a model our attention would run wrong
        (checked for contexts up to max_model_len, default the model's own limit). compile:
        run the forward through replica/model/compiled_step.py, compiled here (or loaded from its
        cache) before the first request. lora_slots: LoRA adapters one step can run (0: none;
        replica/model/lora.py wraps the Linear layers for them, and compile must be off)."""
        attention.register()
        self.device, self.dtype, self.block_size = device, dtype, block_size
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, attn_implementation=attention.PAGED_ATTENTION
        ).to(device)
        self.model.eval()
        self.shape = ModelShape.from_config(self.model.config)
        limit = self.shape.max_position_embeddings
        attention.check_supported(self.model, min(max_model_len or limit, limit))
        fused.fuse_projections(self.model)
        if packed_linear.packable(self.model):
            packed_linear.pack_linears(self.model)
        if lora_slots and compile:
            raise ValueError("LoRA adapters run the eager forward: compile must be off")
        self.lora = lora.LoraModel(self.model, lora_slots, max_lora_rank) if lora_slots else None
        self.pool = KVPool.allocate(
            self.shape.num_layers, num_blocks * block_size, self.shape.num_kv_heads, self.shape.head_dim, dtype, device
        )
        # decode attention through replica/kernels/cpu_attention.py's kernel where it takes this pool
        self.cpu_decode = cpu_attention.supports(self.pool.k[0], self.shape.num_heads, block_size)
        self.compiled: CompiledForward | None = None
        self.compile_stats: CompileStats | None = None
        if compile:
            # torch.compile's imports, only when used
            from replica.model.compiled_step import CompiledForward

            self.compiled = CompiledForward(self.model)
            self.compile_stats = self.compiled.warm_up(self.pool, block_size, WARM_UP_SIZES)

    @staticmethod
    def read_shape(model_path: str) -> ModelShape:
        return ModelShape.from_config(AutoConfig.from_pretrained(model_path))

    def _slots(self, block_ids: list[int], start: int, end: int) -> list[int]:
        """Pool slots of positions [start, end): only the blocks those positions touch."""
        bs = self.block_size
        slots: list[int] = []
        for b in range(start // bs, -(-end // bs)):
            base = block_ids[b] * bs
            slots.extend(range(base + max(start - b * bs, 0), base + min(end - b * bs, bs)))
        return slots

    def prepare(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flatten the step's chunks into model inputs and attention metadata.

        Single-token chunks (decodes) are laid out first: clustered by the physical prefix blocks
        they share (_prefix_clusters), then sorted by context length and grouped
        (attention.plan_decode_groups); longer chunks attend one request at a time. `chunks`
        is reordered in place to match. Work per step follows the new tokens (slots are computed
        for them only) plus one block id per decode's context block. With the CPU decode kernel
        (cpu_decode) the decodes get their whole block tables instead of cascades and groups; the
        clustering still puts rows that share a prefix next to each other, which the kernel's
        cache reuse relies on.
        """
        bs = self.block_size
        # a decode computes one token at the end of a sequence; a one-token chunk in the middle of
        # a prompt (the step's token budget ran out) is a prefill chunk that samples nothing
        clusters = _prefix_clusters([c for c in chunks if _is_decode(c)], bs)
        decodes = [c for rows, _ in clusters for c in rows]
        prefills = [c for c in chunks if not _is_decode(c)]
        chunks[:] = decodes + prefills
        ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        sample_rows: list[int] = []
        for c in decodes:
            pos = c.start
            ids.append(c.seq.token_ids[pos])
            positions.append(pos)
            slot_mapping.append(c.seq.table.block_ids[pos // bs] * bs + pos % bs)
        sample_rows.extend(range(len(decodes)))  # a decode always reaches its last token
        segments: list[PrefillSegment] = []
        for c in prefills:
            q_start = len(ids)
            ids += c.seq.token_ids[c.start : c.end]
            positions += range(c.start, c.end)
            slot_mapping += self._slots(c.seq.table.block_ids, c.start, c.end)
            if c.samples:
                sample_rows.append(len(ids) - 1)
            if c.start == 0:
                segments.append(PrefillSegment(q_start, len(ids), None, None))
            else:
                kv_slots = torch.tensor(self._slots(c.seq.table.block_ids, 0, c.end), dtype=torch.long)
                q_pos = torch.arange(c.start, c.end)
                mask = torch.arange(c.end)[None, :] <= q_pos[:, None]
                segments.append(PrefillSegment(q_start, len(ids), kv_slots.to(self.device), mask.to(self.device)))
        meta = AttentionMetadata(
            pool=self.pool, slot_mapping=torch.tensor(slot_mapping, dtype=torch.long).to(self.device),
            prefills=segments, block_size=bs, num_decodes=len(decodes),
            max_context=max((c.end for c in chunks), default=0),
        )
        if self.cpu_decode and attention.default_backend():
            meta.decode_tables, meta.decode_offsets, meta.decode_lens = self._decode_tables(decodes)
            clusters = []  # the kernel reads each row's whole table: no cascades to build
        row = 0
        for rows, shared in clusters:
            prefix = None
            if shared:
                prefix = torch.tensor(rows[0].seq.table.block_ids[:shared], dtype=torch.long).to(self.device)
            cascade = DecodeCascade(row, row + len(rows), prefix)
            lengths = [c.end - shared * bs for c in rows]  # what each row attends beyond the prefix
            for start, end in attention.plan_decode_groups(lengths):
                cascade.groups.append(self._decode_group(rows, lengths, start, end, shared, row))
            meta.decode_cascades.append(cascade)
            row += len(rows)
        return (
            torch.tensor([ids], device=self.device),
            torch.tensor([positions], device=self.device),
            meta,
            torch.tensor(sample_rows, dtype=torch.long, device=self.device),
        )

    def _decode_tables(self, decodes: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every decode row's blocks, concatenated, where each row's start, and its context length."""
        bs = self.block_size
        tables: list[int] = []
        offsets = [0]
        for c in decodes:
            tables += c.seq.table.block_ids[: -(-c.end // bs)]
            offsets.append(len(tables))
        lens = [c.end for c in decodes]
        return tuple(torch.tensor(x, dtype=torch.long) for x in (tables, offsets, lens))

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
            mask = valid[None, :, None, :].to(self.device)
        return DecodeGroup(offset + start, offset + end, tables.to(self.device), mask)

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """One forward pass; returns float32 logits for the chunks that sample, in chunk order.

        `chunks` is reordered in place to the order the rows were laid out (decodes first).
        """
        input_ids, positions, meta, sample_rows = self.prepare(chunks)
        attention.set_metadata(meta)
        lora.set_rows(self._lora_rows(chunks))
        try:
            if self.compiled is not None:
                return self.compiled(input_ids, positions, sample_rows).float()
            out = self.model(
                input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=sample_rows
            )
        finally:
            attention.set_metadata(None)
            lora.set_rows(None)
        return out.logits[0].float()

    def _lora_rows(self, chunks: list[ScheduledChunk]) -> lora.RowSlots | None:
        """Each row's adapter slot, in the order prepare() laid the rows out (None: no adapter rows)."""
        if self.lora is None or all(c.seq.lora_slot < 0 for c in chunks):
            return None
        slots = [c.seq.lora_slot for c in chunks for _ in range(c.end - c.start)]
        return lora.RowSlots(torch.tensor(slots, device=self.device), self.lora.num_slots, set(slots) - {-1})


def _is_decode(c: ScheduledChunk) -> bool:
    return c.end - c.start == 1 and c.start > 0 and c.samples


MIN_CASCADE_SAVED_BLOCKS = 4  # below this, the cascade's extra small operations cost more than the reads they save


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
