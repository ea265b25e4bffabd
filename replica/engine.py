"""LLMEngine: the paged prefix-cache engine every replica runs.

    from replica.engine import LLMEngine, SamplingParams
    engine = LLMEngine(model=None, block_size=16, num_blocks=1024)   # None: bundled default
    [out] = engine.generate(["What is the capital of France?"], SamplingParams(max_tokens=16))

`step()` runs one batched forward pass and returns per-request deltas; `generate()` loops it.
The async, streaming front for servers is replica.async_engine.AsyncLLMEngine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig

from replica import kv_transfer
from replica.block_manager import BlockManager, KVEventListener
from replica.constrained import Grammars
from replica.default_model import resolve_model
from replica.detokenizer import Detokenizer
from replica.engine_types import (
    EngineConfig,
    EngineStats,
    InvalidRequestError,
    RequestOutput,
    request_output,
    validate_request,
)
from replica.model_runner import ModelRunner, default_dtype
from replica.sampler import Sampler
from replica.sampling_params import SamplingParams
from replica.scheduler import Scheduler, SchedulerConfig
from replica.sequence import Sequence
from replica.token_text import TokenText
from router.protocol.hashing import block_hashes, chain_seed

log = logging.getLogger("prefixgate.replica.engine")

__all__ = ["LLMEngine", "SamplingParams", "RequestOutput", "EngineConfig", "InvalidRequestError"]


class LLMEngine:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        config = kwargs.pop("config", None) or EngineConfig(model=model, **kwargs)
        self.config = config
        path = resolve_model(config.model)
        self.model_path = Path(path)
        self.model_id = config.model_id or self.model_path.name
        device = torch.device(config.device)
        dtype = getattr(torch, config.dtype) if config.dtype else default_dtype(device)
        shape = ModelRunner.read_shape(str(path))
        num_blocks = config.num_blocks or max(16, config.kv_cache_bytes // shape.bytes_per_block(config.block_size, dtype))
        self.runner = ModelRunner(str(path), block_size=config.block_size, num_blocks=num_blocks, device=device, dtype=dtype,
                                  max_model_len=config.max_model_len)
        self.shape = self.runner.shape
        self.max_model_len = min(config.max_model_len or self.shape.max_position_embeddings, self.shape.max_position_embeddings)
        self.vocab_size = self.runner.model.get_input_embeddings().num_embeddings
        self.tokenizer = _load_tokenizer(path)
        self.eos_token_ids = _eos_ids(path, self.tokenizer)
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens), self.blocks)
        self.sampler = Sampler(Grammars(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids)), sorted(self.eos_token_ids))
        self.token_text = TokenText(self.tokenizer)  # logprobs: token ids to OpenAI's token/bytes
        self.detokenizer = Detokenizer(self.tokenizer)
        self.requests: dict[str, Sequence] = {}
        self._seeds: dict[str | None, int] = {}
        self._steps = 0
        self._generated = 0
        self._scheduled_at: dict[str, float] = {}  # request id -> first scheduled (queue time)
        self.kv_imported_blocks = 0  # blocks pulled from other replicas into this cache
        self.kv_import_failures = 0  # pulled payloads refused (another shape, a bad payload): recomputed

    # ---- submission ---------------------------------------------------------------------
    def add_listener(self, listener: KVEventListener) -> None:
        self.blocks.listeners.append(listener)

    def hash_seed(self, cache_salt: str | None = None) -> int:
        if cache_salt not in self._seeds:
            self._seeds[cache_salt] = chain_seed(self.model_id, cache_salt)
        return self._seeds[cache_salt]

    def tokenize(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("this model has no chat template")
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Refuse what could never run, before it touches the scheduler."""
        validate_request(token_ids, params, self.vocab_size, self.max_model_len, self.blocks)

    def add_request(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        prefix_output_token_ids: Seq[int] = (),
        prefix_text_len: int | None = None,
        kv_prefix: kv_transfer.KvBlocks | None = None,
    ) -> str:
        """prefix_output_token_ids: output another replica already generated and sent (a
        migrated stream). They count as this request's output for max_tokens, stop strings
        and text, and are recomputed (or hit in the cache) with the prompt; prefix_text_len
        is how much of their text the client has seen (default: all of it). kv_prefix: the
        prompt's leading blocks pulled from another replica, imported into the cache before
        the request is queued (docs/kv-pull.md); blocks that do not fit are recomputed."""
        params = params or SamplingParams()
        token_ids = self.tokenize(prompt)
        self.validate(token_ids, params)
        prefix = list(prefix_output_token_ids)
        if prefix:
            self._check_prefix(prefix, params)
        seed = self.hash_seed(cache_salt)
        seq = Sequence(token_ids, params, seed, **({"request_id": request_id} if request_id else {}))
        if seq.request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {seq.request_id}")
        if prefix:
            seq.token_ids.extend(prefix)
            seq.emitted_tokens = len(prefix)
            self.detokenizer.update(seq)
            sent = len(seq.output_text) if prefix_text_len is None else prefix_text_len
            seq.emitted_text_len = max(0, min(sent, len(seq.output_text)))
        seq.table.hashes = block_hashes(seq.token_ids, self.config.block_size, seed)
        seq.arrival_time = time.monotonic()
        try:
            self.sampler.add(seq)  # compiles a response_format grammar: refused here, not mid-batch
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        if kv_prefix is not None:
            self._import_kv(kv_prefix, seq)
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
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

    def _check_prefix(self, prefix: list[int], params: SamplingParams) -> None:
        if len(prefix) >= params.max_tokens:
            raise InvalidRequestError("prefix_output_token_ids must be shorter than max_tokens")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size for t in prefix):
            raise InvalidRequestError(f"prefix_output_token_ids must be integers in [0, {self.vocab_size})")

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False if it is unknown or already done."""
        seq = self.requests.pop(request_id, None)
        self._scheduled_at.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        self.sampler.forget(request_id)
        return True

    # ---- stepping -----------------------------------------------------------------------
    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[RequestOutput]:
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        scheduled = time.monotonic()
        for c in chunks:
            self._scheduled_at.setdefault(c.seq.request_id, scheduled)
        logits = self.runner.run(chunks)
        self.scheduler.commit(chunks)
        self._steps += 1
        samplers = [c.seq for c in chunks if c.samples]
        sampled = self.sampler.sample(logits, samplers)
        outputs: list[RequestOutput] = []
        now = time.monotonic()
        for seq, token, logprob in zip(samplers, sampled.token_ids, sampled.logprobs, strict=True):
            seq.token_ids.append(token)
            self._generated += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            outputs.append(self._output(seq))
            if logprob is not None:
                outputs[-1].logprobs = [self.token_text.entry(logprob)]
            if seq.is_finished:
                self.requests.pop(seq.request_id, None)
                self.sampler.forget(seq.request_id)
        return outputs

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        n = len(seq.output_token_ids)  # min_tokens as vLLM: stop ids are masked before it, stop strings wait past it
        if n >= p.min_tokens and (token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)):
            self.detokenizer.update(seq)
            return "stop"
        if self.detokenizer.update(seq, check_stops=n > p.min_tokens) is not None:
            return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, seq: Sequence) -> RequestOutput:
        scheduled_at = self._scheduled_at.pop(seq.request_id, None) if seq.is_finished else None
        return request_output(seq, self.detokenizer.emittable(seq), scheduled_at)

    def generate(
        self,
        prompts: Seq[str] | Seq[Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion together (continuous batching); one output per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise InvalidRequestError("generate() takes a list of prompts")
        param_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        ids = [self.add_request(p, sp, cache_salt=cache_salt) for p, sp in zip(prompts, param_list, strict=True)]
        final: dict[str, RequestOutput] = {}
        logprobs: dict[str, list[dict]] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.logprobs:
                    logprobs.setdefault(out.request_id, []).extend(out.logprobs)
                if out.finished:
                    final[out.request_id] = out
                    if out.request_id in logprobs:  # the whole output's logprobs, not the last token's
                        out.logprobs = logprobs.pop(out.request_id)
        return [final[i] for i in ids]

    def stats(self) -> EngineStats:
        b = self.blocks
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            prompt_tokens=b.stats.queried_tokens,
            cached_tokens=b.stats.hit_tokens,
            blocks_total=b.num_blocks,
            blocks_used=b.num_used,
            blocks_cached=b.num_cached,
            blocks_free=b.num_free,
            evictions=b.stats.evictions,
            preemptions=self.scheduler.num_preemptions,
            pending_prefill_tokens=sum(
                s.num_tokens - s.num_computed for s in (*self.scheduler.waiting, *self.scheduler.running)
            ),
            steps=self._steps,
            generated_tokens=self._generated,
        )


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
