"""Loads a transformers model with paged attention and runs one batched step over the pool."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from replica import attention
from replica.attention import AttentionMetadata, KVPool, PrefillSegment
from replica.scheduler import ScheduledChunk


@dataclass
class ModelShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int

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
        )

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * itemsize


def default_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


class ModelRunner:
    def __init__(
        self, model_path: str, *, block_size: int, num_blocks: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        attention.register()
        self.device, self.dtype, self.block_size = device, dtype, block_size
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, attn_implementation=attention.PAGED_ATTENTION
        ).to(device)
        self.model.eval()
        self.shape = ModelShape.from_config(self.model.config)
        self.pool = KVPool.allocate(
            self.shape.num_layers, num_blocks * block_size, self.shape.num_kv_heads, self.shape.head_dim, dtype, device
        )

    @staticmethod
    def read_shape(model_path: str) -> ModelShape:
        return ModelShape.from_config(AutoConfig.from_pretrained(model_path))

    def _slots(self, block_ids: list[int], length: int) -> torch.Tensor:
        table = torch.tensor(block_ids, dtype=torch.long)
        offsets = torch.arange(self.block_size, dtype=torch.long)
        return (table[:, None] * self.block_size + offsets).view(-1)[:length]

    def prepare(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flatten the step's chunks into model inputs and attention metadata.

        Single-token chunks (decodes) are laid out first and attended in one batched call;
        longer chunks attend one request at a time. `chunks` is reordered in place to match.
        """
        decodes = [c for c in chunks if c.end - c.start == 1 and c.start > 0]
        prefills = [c for c in chunks if not (c.end - c.start == 1 and c.start > 0)]
        chunks[:] = decodes + prefills
        ids: list[int] = []
        positions: list[int] = []
        slot_parts: list[torch.Tensor] = []
        sample_rows: list[int] = []
        segments: list[PrefillSegment] = []
        max_blocks = max((len(c.seq.table.block_ids) for c in decodes), default=0)
        decode_tables = torch.zeros(len(decodes), max_blocks, dtype=torch.long)
        for i, c in enumerate(chunks):
            q_start = len(ids)
            ids += c.seq.token_ids[c.start : c.end]
            positions += range(c.start, c.end)
            slots = self._slots(c.seq.table.block_ids, c.end)
            slot_parts.append(slots[c.start :])
            if c.samples:
                sample_rows.append(len(ids) - 1)
            if i < len(decodes):
                table = c.seq.table.block_ids
                decode_tables[i, : len(table)] = torch.tensor(table, dtype=torch.long)
            elif c.start == 0:
                segments.append(PrefillSegment(q_start, len(ids), None, None))
            else:
                q_pos = torch.arange(c.start, c.end)
                mask = torch.arange(c.end)[None, :] <= q_pos[:, None]
                segments.append(PrefillSegment(q_start, len(ids), slots.to(self.device), mask.to(self.device)))
        meta = AttentionMetadata(
            pool=self.pool, slot_mapping=torch.cat(slot_parts).to(self.device), prefills=segments,
            block_size=self.block_size,
        )
        if decodes:
            lengths = torch.tensor([c.end for c in decodes])
            valid = torch.arange(max_blocks * self.block_size)[None, :] < lengths[:, None]
            meta.num_decodes = len(decodes)
            meta.decode_block_tables = decode_tables.to(self.device)
            meta.decode_mask = valid[:, None, None, :].to(self.device)
        return (
            torch.tensor([ids], device=self.device),
            torch.tensor([positions], device=self.device),
            meta,
            torch.tensor(sample_rows, dtype=torch.long, device=self.device),
        )

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """One forward pass; returns float32 logits for the chunks that sample, in chunk order.

        `chunks` is reordered in place to the order the rows were laid out (decodes first).
        """
        input_ids, positions, meta, sample_rows = self.prepare(chunks)
        attention.set_metadata(meta)
        try:
            out = self.model(
                input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=sample_rows
            )
        finally:
            attention.set_metadata(None)
        return out.logits[0].float()
