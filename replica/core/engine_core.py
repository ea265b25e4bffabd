"""EngineCore: the rules our engines share, torch-free; what a step computes is swappable.

One engine (nano-vllm's shape): admission and validation, migrated-stream continuations,
scheduling (replica/core/scheduler.py), finishing (end-of-sequence and stop ids, stop strings,
min_tokens, length), outputs and stats live here once. What one step computes is the
`StepExecutor`: the model's forward pass and sampler (replica/engine.py, `LLMEngine`), or a
sleep of the modelled step time with deterministic fake tokens (replica/backends/sim_engine.py,
`SimEngine`). So the simulated replica is this engine with its forward pass replaced, and a
rule changed here changes both.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from replica.core.adapter_slots import AdapterSlots
from replica.core.detokenizer import Detokenizer
from replica.core.engine_types import (
    EngineStats,
    InvalidRequestError,
    RequestOutput,
    TierUsage,
    UnknownAdapterError,
    refuse_unfit,
    request_output,
)
from replica.core.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from replica.core.sequence import Sequence
from replica.core.step_timings import StepTotals, chunk_shape
from replica.kvcache.block_manager import BlockManager
from replica.kvcache.kv_tiers import CopyStats, TierMover
from router.protocol.events import KVEventListener
from router.protocol.hashing import block_hashes, chain_seed
from router.protocol.lora import AdapterRef
from router.protocol.messages import GenerateRequest
from router.protocol.sampling import SamplingParams

log = logging.getLogger("prefixgate.replica.engine")


class StepExecutor(Protocol):
    def execute(self, chunks: list[ScheduledChunk], admitted: set[int]
                ) -> tuple[list[Sequence], list[int], list[dict | None]]:
        """Compute one scheduled step; returns the sequences whose chunk reached their last
        token (in the order the executor laid them out: the model runner reorders `chunks`),
        the next token of each and, where it asked for logprobs, that token's entry
        (replica/model/token_text.py's wire form). `admitted`: ids of the sequences this step
        admitted (a prefill's start)."""
        ...


class EngineCore:
    def __init__(self, *, model_id: str, block_size: int, num_blocks: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, vocab_size: int, eos_token_ids: set[int],
                 detokenizer: Detokenizer, executor: StepExecutor, host_blocks: int = 0, disk_blocks: int = 0,
                 mover: TierMover | None = None, max_loras: int = 0, long_prefill_token_threshold: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """host_blocks / disk_blocks: the K/V tiers below the pool (replica/kvcache/kv_tiers.py); `mover`
        holds their bytes and runs the copies (None: the tiers are bookkeeping only, the
        simulated replica's case). max_loras: LoRA adapters in one batch (0: no adapters).
        `clock`: the seconds every time of a request and of a step is read from (arrival, first
        token, step time, objectives); a manual clock makes a simulated engine deterministic."""
        self.clock = clock
        self.model_id = model_id
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.blocks = BlockManager(num_blocks, block_size, host_blocks, disk_blocks, record_moves=mover is not None)
        self.mover = mover
        # write-behind of the pool's cold end into the first tier, during the forward pass
        self._writeback_blocks = max(8, max_num_batched_tokens // block_size)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-writeback") if mover is not None and self.blocks.tiers else None
        self.adapter_slots = AdapterSlots(max_loras) if max_loras else None
        self.adapters: dict[str, AdapterRef] = {}  # served LoRA adapters by name
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, long_prefill_token_threshold),
                                   self.blocks, self.adapter_slots, clock=clock)
        self.detokenizer = detokenizer
        self.executor = executor
        self.requests: dict[str, Sequence] = {}
        self._block_size = block_size
        self._seeds: dict[str | None, int] = {}
        self._steps = 0
        self.step_totals = StepTotals()  # the heartbeat's step_* fields (router/latency_model.py learns from them)
        self._generated = 0
        self._scheduled_at: dict[str, float] = {}  # request id -> first scheduled (queue time)

    # ---- submission ---------------------------------------------------------------------
    def add_listener(self, listener: KVEventListener) -> None:
        self.blocks.listeners.append(listener)

    def hash_seed(self, cache_salt: str | None = None, adapter: str | None = None) -> int:
        """The chain's root for a tenant salt and an adapter identity (AdapterRef.identity)."""
        key = (cache_salt, adapter)
        if key not in self._seeds:
            self._seeds[key] = chain_seed(self.model_id, cache_salt, adapter)
        return self._seeds[key]

    # ---- LoRA adapters ------------------------------------------------------------------
    def add_adapter(self, ref: AdapterRef) -> None:
        """Serve `ref` under its name (replacing an idle adapter of that name)."""
        if self.adapter_slots is None:
            raise InvalidRequestError("this engine was started without LoRA (max_loras 0)")
        old = self.adapters.get(ref.name)
        if old is not None and old != ref:
            self.remove_adapter(ref.name)
        self.adapters[ref.name] = ref

    def remove_adapter(self, name: str) -> None:
        """Stop serving adapter `name`; refused while requests for it are queued or running."""
        if name not in self.adapters:
            raise UnknownAdapterError(f"adapter {name!r} is not loaded")
        if any(s.adapter == name for s in self.requests.values()):
            raise InvalidRequestError(f"adapter {name!r} has requests in flight: unload it when they finish")
        del self.adapters[name]
        self.adapter_slots.drop(name)

    def tokenize(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            raise InvalidRequestError("this engine takes token ids, not text")
        return prompt if type(prompt) is list else list(prompt)

    def request(self, prompt: str | Seq[int], params: SamplingParams | None = None, request_id: str | None = None,
                cache_salt: str | None = None, prefix_output_token_ids: Seq[int] = (),
                prefix_text_len: int | None = None, adapter: str | None = None, priority: int = 0) -> GenerateRequest:
        """The request struct the library's keyword form (`add_request`) describes: text is
        tokenised, a list of token ids is taken as it is (not copied: leave it unchanged while
        the request runs), `adapter` names a served adapter (UnknownAdapterError if none)."""
        ref = None
        if adapter is not None:
            ref = self.adapters.get(adapter)
            if ref is None:
                raise UnknownAdapterError(f"adapter {adapter!r} is not loaded on this replica")
        return GenerateRequest(
            prompt_token_ids=self.tokenize(prompt), params=params or SamplingParams(),
            **({"request_id": request_id} if request_id else {}), cache_salt=cache_salt, adapter=ref,
            priority=priority, prefix_output_token_ids=list(prefix_output_token_ids), prefix_text_len=prefix_text_len,
        )

    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None, request_id: str | None = None,
                    cache_salt: str | None = None, *, prefix_output_token_ids: Seq[int] = (),
                    prefix_text_len: int | None = None, adapter: str | None = None, priority: int = 0,
                    kv_prefix: Any = None) -> str:
        """The library's entry: queue a request given as keywords (see `request`; `new_sequence`
        for a migrated stream's prefix; `add` for kv_prefix); `priority`: vLLM's, lower first."""
        return self.add(self.request(prompt, params, request_id, cache_salt, prefix_output_token_ids,
                                     prefix_text_len, adapter, priority), kv_prefix)

    def add(self, request: GenerateRequest, kv_prefix: Any = None) -> str:
        """Queue `request` as it came (the backends' way in); returns its id. `kv_prefix`: K/V
        blocks a pull brought from another replica, where the engine imports them (ours)."""
        if kv_prefix is not None:
            raise InvalidRequestError("this engine takes no pulled K/V")
        seq = self.new_sequence(request)
        self.enqueue(seq)
        return seq.request_id

    def new_sequence(self, request: GenerateRequest) -> Sequence:
        """A checked sequence, not queued yet. A migrated stream's prefix_output_token_ids:
        output another replica already generated and sent; they count as this request's output
        for max_tokens, stop strings and text, and are recomputed (or hit in the cache) with the
        prompt; prefix_text_len is how much of their text the client has seen (None: all)."""
        ref = None
        if request.adapter is not None:
            ref = self.adapters.get(request.adapter.name)
            if ref is None:
                raise UnknownAdapterError(f"adapter {request.adapter.name!r} is not loaded on this replica")
        refuse_unfit(request, self.vocab_size, self.max_model_len, self._block_size, self.blocks.num_blocks)
        if request.request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request.request_id}")
        seed = self.hash_seed(request.cache_salt, ref.identity if ref else None)
        seq = Sequence(request.prompt_token_ids, request.params, seed, request_id=request.request_id)
        seq.adapter = ref.name if ref else None
        seq.priority = request.priority
        if request.objectives is not None:  # steps are sized to them (replica/core/step_sizing.py)
            ttft, tpot = request.objectives.ttft_ms, request.objectives.tpot_ms
            seq.ttft_s = ttft / 1000 if ttft is not None else None
            seq.tpot_s = tpot / 1000 if tpot is not None else None
        prefix = request.prefix_output_token_ids
        if prefix:
            seq.token_ids.extend(prefix)
            seq.emitted_tokens = len(prefix)
            self.detokenizer.update(seq, check_stops=False)
            sent = len(seq.output_text) if request.prefix_text_len is None else request.prefix_text_len
            seq.emitted_text_len = max(0, min(sent, len(seq.output_text)))
        seq.table.hashes = block_hashes(seq.token_ids, self._block_size, seq.hash_seed)
        seq.arrival_time = self.clock()
        return seq

    def enqueue(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False if it is unknown or already done."""
        seq = self.requests.pop(request_id, None)
        self._scheduled_at.pop(request_id, None)
        if seq is None:
            return False
        self.forget(request_id)
        self.scheduler.finish(seq, "abort")
        return True

    def forget(self, request_id: str) -> None:
        """A request left (finished or aborted): drop what the executor keeps for it."""

    # ---- stepping -----------------------------------------------------------------------
    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[RequestOutput]:
        before = {id(s) for s in self.scheduler.running}
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        self.apply_tier_moves()  # blocks promoted for this step hold their K/V before it runs
        scheduled = self.clock()
        for c in chunks:
            self._scheduled_at.setdefault(c.seq.request_id, scheduled)
        writing = self._start_writeback()
        admitted = {id(c.seq) for c in chunks} - before
        try:
            samplers, tokens, logprobs = self.executor.execute(chunks, admitted)
        finally:
            if writing is not None:
                failed = writing.exception()
                if failed is not None:  # the copies are forgotten: those blocks are copied when evicted
                    log.warning("K/V write-behind failed: %r", failed)
                self.blocks.finish_writeback(ok=failed is None)
        self.scheduler.commit(chunks)
        self._steps += 1
        now = self.clock()
        self.step_totals.record(now - scheduled, *chunk_shape(chunks), len(admitted))
        self.scheduler.sizer.learn(self.step_totals, now)  # the step model objectives size steps by
        outputs: list[RequestOutput] = []
        for seq, token, logprob in zip(samplers, tokens, logprobs, strict=True):
            seq.token_ids.append(token)
            self._generated += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self.finish_reason(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            outputs.append(self._output(seq))
            if logprob is not None:
                outputs[-1].logprobs = [logprob]
            if seq.is_finished:
                self.requests.pop(seq.request_id, None)
                self.forget(seq.request_id)
        return outputs

    def apply_tier_moves(self) -> None:
        """Run the tier copies the block manager decided: before any forward pass or K/V import
        reads or writes the blocks they touch (engine thread)."""
        moves = self.blocks.take_moves()
        if moves and self.mover is not None:
            self.mover.apply(moves)

    def _start_writeback(self) -> Future | None:
        """Copy the pool's coldest cached blocks down while the forward pass runs: blocks it
        does not read (unreferenced), pinned until the copy is done. A later eviction of them
        then copies nothing on the step (BlockManager.plan_writeback)."""
        if self._writer is None:
            return None
        moves = self.blocks.plan_writeback(self._writeback_blocks, 2 * self._writeback_blocks)
        return self._writer.submit(self.mover.apply, moves) if moves else None

    def tier_usage(self) -> dict[str, TierUsage]:
        copies = self.mover.stats if self.mover is not None else CopyStats()
        usage = {}
        for tier in self.blocks.tiers:
            m = tier.medium
            usage[m] = TierUsage(
                capacity_blocks=tier.capacity, blocks=len(tier),
                hit_tokens=self.blocks.stats.tier_hit_tokens.get(m, 0),
                promotions=tier.stats.promotions, demotions=tier.stats.demotions, dropped=tier.stats.dropped,
                written_behind=self.blocks.stats.writeback_hits if tier is self.blocks.tiers[0] else 0,
                bytes_in=sum(n for (_, dst), n in copies.bytes.items() if dst == m),
                bytes_out=sum(n for (src, _), n in copies.bytes.items() if src == m),
                promotion_bytes_per_s=copies.promotion_rate(m),
            )
        return usage

    def finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        n = seq.num_output_tokens  # min_tokens as vLLM: stop ids are masked before it, stop strings wait past it
        if n >= p.min_tokens and (token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)):
            self.detokenizer.update(seq)
            return "stop"
        if self.detokenizer.update(seq, check_stops=n > p.min_tokens) is not None:
            return "stop"
        if n >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, seq: Sequence) -> RequestOutput:
        scheduled_at = self._scheduled_at.pop(seq.request_id, None) if seq.is_finished else None
        return request_output(seq, self.detokenizer.emittable(seq), scheduled_at, self.clock())

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

    def queued_elsewhere(self) -> tuple[int, int]:
        """(requests, prompt tokens) admitted but not in the scheduler yet (a modelled pull)."""
        return 0, 0

    def queued_by_priority(self) -> dict[int, tuple[int, int]]:
        """{priority: (sequences waiting, tokens not computed yet of the waiting and the running)}:
        the work a new request of each priority waits for (the router's latency model)."""
        out: dict[int, tuple[int, int]] = {}
        for seqs, waiting in ((self.scheduler.waiting, 1), (self.scheduler.running, 0)):
            for s in seqs:
                left = s.num_tokens - s.num_computed
                if waiting or left:
                    n, t = out.get(s.priority, (0, 0))
                    out[s.priority] = (n + waiting, t + left)
        return out

    def stats(self) -> EngineStats:
        b = self.blocks
        waiting, pending = self.queued_elsewhere()
        by_priority = self.queued_by_priority()
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting) + waiting,
            prompt_tokens=b.stats.queried_tokens,
            cached_tokens=b.stats.hit_tokens,
            blocks_total=b.num_blocks,
            blocks_used=b.num_used,
            blocks_cached=b.num_cached,
            blocks_free=b.num_free,
            evictions=b.stats.evictions,
            preemptions=self.scheduler.num_preemptions,
            pending_prefill_tokens=sum(queued[1] for queued in by_priority.values()) + pending,
            steps=self._steps,
            generated_tokens=self._generated,
            context_tokens=sum(s.num_tokens for s in self.scheduler.running),
            step_token_budget=self.scheduler.config.max_num_batched_tokens,
            queued_by_priority=by_priority,
            step_totals=dataclasses.replace(self.step_totals),  # a copy: the snapshot outlives this step
            tiers=self.tier_usage(),
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict:
        slots = self.adapter_slots
        if slots is None:
            return {}
        waiting = sorted({s.adapter for s in self.scheduler.waiting if s.adapter is not None})
        return {"lora_running": slots.running(), "lora_waiting": waiting, "max_loras": slots.max_loras}
