"""Loads a transformers model with paged attention and runs one batched step over the pool."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from replica.core.scheduler import ScheduledChunk
from replica.engine_config import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS
from replica.kernels import attention, cpu_attention
from replica.kernels.attention_metadata import AttentionMetadata, KVPool
from replica.model import fused, layer_forward, lora, packed_linear
from replica.model.step_inputs import StepInputs

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
        max_num_seqs: int = MAX_NUM_SEQS, max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
    ) -> None:
        """Raises attention.UnsupportedModelError for a model our attention would run wrong
        (checked for contexts up to max_model_len, default the model's own limit). compile:
        run the forward through replica/model/compiled_step.py, compiled here (or loaded from its
        cache) before the first request. lora_slots: LoRA adapters one step can run (0: none;
        replica/model/lora.py wraps the Linear layers for them, and compile must be off).
        max_num_seqs, max_num_batched_tokens: the scheduler's limits, which size the persistent
        batch's buffers (replica/model/input_batch.py) once."""
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
        max_len = min(max_model_len or limit, limit)
        self.inputs = StepInputs(self.pool, block_size, device, max_rows=max_num_seqs, cpu_decode=self.cpu_decode,
                                 max_tokens=max(max_num_batched_tokens, max_num_seqs),
                                 max_blocks=min(-(-max_len // block_size), num_blocks))
        self.compiled: CompiledForward | None = None
        self.compile_stats: CompileStats | None = None
        if compile:
            # torch.compile's imports, only when used
            from replica.model.compiled_step import CompiledForward

            self.compiled = CompiledForward(self.model)
            self.compile_stats = self.compiled.warm_up(self.pool, block_size, WARM_UP_SIZES)
            small = layer_forward.step_threads(self.widest_product or 0, max(WARM_UP_SIZES), adapters=False)
            if self.widest_product is not None and small is not None:  # small steps run on one thread
                with layer_forward.one_thread(small):  # (step_threads): their graph, compiled now
                    self.compiled.warm_up(self.pool, block_size, WARM_UP_SIZES)

    @staticmethod
    def read_shape(model_path: str) -> ModelShape:
        return ModelShape.from_config(AutoConfig.from_pretrained(model_path))

    def prepare(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The step's inputs over the persistent batch (StepInputs.prepare); reorders `chunks`."""
        return self.inputs.prepare(chunks)

    def step_threads(self, chunks: list[ScheduledChunk]) -> AbstractContextManager[None]:
        """Where the step runs: on one thread when it is small for this model (layer_forward's
        rule: a CPU model whose layers fused.py owns, eager, no adapter rows), else as it is.
        Covers the forward, lm_head and the sampler's ops (ModelStep). The compiled forward's
        graph is guarded on the thread count: warm_up compiles one for each count it runs on."""
        widest = self.widest_product
        if widest is None:
            return nullcontext()
        tokens = sum(c.end - c.start for c in chunks)
        adapters = self.lora is not None and any(c.seq.lora_slot >= 0 for c in chunks)
        return layer_forward.one_thread(layer_forward.step_threads(widest, tokens, adapters))

    @property
    def widest_product(self) -> int | None:
        """The widest product (in x out) of a CPU model whose layers layer_forward owns, else None
        (the one-thread rule does not apply)."""
        if self.device.type != "cpu":
            return None
        return getattr(getattr(self.model, "model", None), "widest_product", None)

    def release(self, request_id: str) -> None:
        """A request left: its row of the persistent batch is free."""
        self.inputs.release(request_id)

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
        """Each token's adapter slot, in the order prepare() laid the rows out (None: no adapter rows)."""
        if self.lora is None or all(c.seq.lora_slot < 0 for c in chunks):
            return None
        per_chunk = np.fromiter((c.seq.lora_slot for c in chunks), np.int64, len(chunks))
        slots = np.repeat(per_chunk, np.fromiter((c.end - c.start for c in chunks), np.int64, len(chunks)))
        rows = torch.from_numpy(slots).to(self.device, non_blocking=True)  # no host sync: see StepInputs._to_device
        return lora.RowSlots(rows, self.lora.num_slots, set(per_chunk.tolist()) - {-1})
