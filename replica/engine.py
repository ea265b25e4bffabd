"""LLMEngine: the paged prefix-cache engine every replica runs.

    from replica.engine import LLMEngine, SamplingParams
    engine = LLMEngine(model=None, block_size=16, num_blocks=1024)   # None: bundled default
    [out] = engine.generate(["What is the capital of France?"], SamplingParams(max_tokens=16))

`step()` runs one batched forward pass and returns per-request deltas; `generate()` loops it.
The async, streaming front for servers is replica.async_engine.AsyncLLMEngine.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig

from replica.core.detokenizer import Detokenizer
from replica.core.engine_core import EngineCore
from replica.core.engine_types import InvalidRequestError, RequestOutput
from replica.core.sequence import Sequence
from replica.default_model import resolve_model
from replica.engine_config import EngineConfig
from replica.kv_io import kv_transfer
from replica.kv_io.kv_tier_store import TierStore
from replica.model import lora
from replica.model.constrained import Grammars
from replica.model.model_runner import ModelRunner, default_dtype
from replica.model.sampler import Sampler
from replica.model.token_text import TokenText
from router.protocol.lora import AdapterError, AdapterRef, adapter_ref
from router.protocol.messages import GenerateRequest
from router.protocol.sampling import SamplingParams

log = logging.getLogger("prefixgate.replica.engine")

__all__ = ["LLMEngine", "SamplingParams", "RequestOutput", "EngineConfig", "InvalidRequestError"]


class ModelStep:
    """The real forward pass: the runner's batched step, then the sampler (StepExecutor)."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, token_text: TokenText,
                 lora_store: lora.AdapterStore | None = None, adapters: dict | None = None) -> None:
        self.runner = runner
        self.sampler = sampler
        self.token_text = token_text  # logprobs: token ids to OpenAI's token/bytes
        self.lora_store = lora_store
        self.adapters = adapters  # the engine's served adapters by name (AdapterRef)

    def execute(self, chunks, admitted):
        if self.lora_store is not None:  # each running adapter's tensors in its batch slot
            for c in chunks:
                if c.seq.lora_slot >= 0:
                    self.lora_store.ensure(c.seq.lora_slot, self.adapters[c.seq.adapter])
        with self.runner.step_threads(chunks):
            logits = self.runner.run(chunks)  # reorders chunks to its rows' order
            samplers = [c.seq for c in chunks if c.samples]
            sampled = self.sampler.sample(logits, samplers)
        entries = [self.token_text.entry(lp) if lp is not None else None for lp in sampled.logprobs]
        return samplers, sampled.token_ids, entries


class LLMEngine(EngineCore):
    def __init__(self, model: str | None = None, **kwargs) -> None:
        config = kwargs.pop("config", None) or EngineConfig(model=model, **kwargs)
        self.config = config
        path = resolve_model(config.model)
        self.model_path = Path(path)
        device = torch.device(config.device)
        dtype = getattr(torch, config.dtype) if config.dtype else default_dtype(device)
        shape = ModelRunner.read_shape(str(path))
        block_bytes = shape.bytes_per_block(config.block_size, dtype)
        num_blocks = config.num_blocks or max(16, config.kv_cache_bytes // block_bytes)
        host_blocks, disk_blocks = config.kv_host_bytes // block_bytes, config.kv_disk_bytes // block_bytes
        compile_ = config.compile and not config.lora
        if config.compile and config.lora:  # as vLLM's CPU platform: LoRA runs eager
            log.warning("compile is off: LoRA adapters run the eager forward")
        self.runner = ModelRunner(str(path), block_size=config.block_size, num_blocks=num_blocks, device=device, dtype=dtype,
                                  max_model_len=config.max_model_len, compile=compile_,
                                  lora_slots=config.max_loras if config.lora else 0, max_lora_rank=config.max_lora_rank,
                                  max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens)
        self.lora_store = lora.AdapterStore(self.runner.lora, config.max_cpu_loras) if config.lora else None
        self.shape = self.runner.shape
        self.tokenizer = _load_tokenizer(path)
        eos = _eos_ids(path, self.tokenizer)
        vocab_size = self.runner.model.get_input_embeddings().num_embeddings
        self.sampler = Sampler(Grammars(self.tokenizer, vocab_size, sorted(eos)), sorted(eos))
        self.token_text = TokenText(self.tokenizer)
        self.tier_store = None
        if host_blocks or disk_blocks:
            self.tier_store = TierStore(self.runner.pool, config.block_size, host_blocks, disk_blocks, config.kv_disk_dir)
        super().__init__(
            model_id=config.model_id or self.model_path.name, block_size=config.block_size, num_blocks=num_blocks,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=min(config.max_model_len or self.shape.max_position_embeddings, self.shape.max_position_embeddings),
            vocab_size=vocab_size, eos_token_ids=eos, detokenizer=Detokenizer(self.tokenizer),
            executor=ModelStep(self.runner, self.sampler, self.token_text, self.lora_store),
            host_blocks=host_blocks, disk_blocks=disk_blocks, mover=self.tier_store,
            max_loras=config.max_loras if config.lora else 0,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
        )
        self.executor.adapters = self.adapters
        for name, adapter_path in config.lora_adapters.items():
            self.add_adapter(adapter_ref(name, adapter_path))
        self.kv_imported_blocks = 0  # blocks pulled from other replicas into this cache
        self.kv_import_failures = 0  # pulled payloads refused (another shape, a bad payload): recomputed

    # ---- submission ---------------------------------------------------------------------
    def tokenize(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt)
        return super().tokenize(prompt)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("this model has no chat template")
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))

    def add(self, request: GenerateRequest, kv_prefix: kv_transfer.KvBlocks | None = None) -> str:
        """Queue `request` (EngineCore.add). kv_prefix: the prompt's leading blocks pulled from
        another replica, imported into the cache before the request is queued (docs/kv-pull.md);
        blocks that do not fit are recomputed. The library's keyword form is `add_request`."""
        seq = self.new_sequence(request)
        try:
            self.sampler.add(seq)  # compiles a response_format grammar: refused here, not mid-batch
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        if kv_prefix is not None:
            self._import_kv(kv_prefix, seq)
        self.enqueue(seq)
        return seq.request_id

    def _import_kv(self, kv: kv_transfer.KvBlocks, seq: Sequence) -> None:
        """Pulled blocks into the cache; a payload that cannot be used only costs a recompute."""
        limit = (seq.num_tokens - 1) // self.config.block_size  # the last token is always computed
        try:
            self.kv_imported_blocks += kv_transfer.import_blocks(self, kv, seq.table.hashes[:limit], seq.token_ids)
        except Exception as err:  # another shape (KvTransferError) or a payload torch refuses
            self.kv_import_failures += 1
            log.warning("pulled K/V refused, the prompt is computed: %s: %s", type(err).__name__, str(err)[:200])
        finally:
            kv.release()  # copied into the pool (or refused): the payload's memory can go

    def forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)
        self.runner.release(request_id)

    def add_adapter(self, ref: AdapterRef) -> None:
        """Read and check the adapter's tensors (AdapterError names the file), then serve it."""
        if self.lora_store is None:
            raise InvalidRequestError("this engine was started without LoRA (enable_lora)")
        try:
            self.lora_store.read(ref)
        except AdapterError as e:
            raise InvalidRequestError(str(e)) from None
        super().add_adapter(ref)

    def _lora_stats(self) -> dict:
        stats = super()._lora_stats()
        if self.lora_store is not None:
            stats.update(lora_resident=list(self.lora_store.resident), lora_load_s=self.lora_store.read_s)
        return stats

    def remove_adapter(self, name: str) -> None:
        ref = self.adapters.get(name)
        super().remove_adapter(name)
        self.lora_store.forget(ref)


def _load_tokenizer(path: Path):
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        return None  # a bare model directory: token ids in, token ids out


def _eos_ids(path: Path, tokenizer) -> set[int]:
    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass
    if tokenizer is not None and tokenizer.eos_token_id is not None and not ids:
        ids.add(tokenizer.eos_token_id)
    return ids
