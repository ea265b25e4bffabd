"""The Ray Serve replica: one engine backend (replica/engine_protocol.py) plus the publisher of
its block hashes. Which backend runs is `ReplicaSettings.engine_name`: our engine, the
simulated one, or vLLM's."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field

from replica.async_engine import EngineDeadError
from replica.drain import drain_replica
from replica.engine_protocol import ENGINE_NAMES, EngineBackend
from replica.engine_types import EngineConfig, InvalidRequestError
from replica.metrics import ReplicaMetrics
from replica.publisher import BlockPublisher, PublisherConfig
from replica.pull_load import add_pull_load
from replica.sampling_params import SamplingParams
from router.protocol.messages import GenerateRequest

log = logging.getLogger("prefixgate.replica")


@dataclass
class ReplicaSettings:
    engine: EngineConfig = field(default_factory=EngineConfig)
    redis_url: str | None = None  # None: run without publishing (routing falls back to hashing)
    key_prefix: str = "prefixgate"
    publish_depth: int = 64
    torch_threads: int = 1  # compute threads per replica (torch's, or vLLM's OMP threads)
    sim: dict | None = None  # SimEngineConfig fields: a simulated-compute replica (no model, no torch)
    kv_pull_timeout_s: float = 5.0  # a pull hint's round trip (docs/kv-pull.md); past it: recompute
    vllm: dict | None = None  # VllmSettings fields: a replica running vLLM's engine (replica/vllm_backend.py)

    @classmethod
    def from_dict(cls, d: dict) -> ReplicaSettings:
        d = dict(d)
        engine = EngineConfig(**d.pop("engine", {}))
        return cls(engine=engine, **d)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def engine_name(self) -> str:
        if self.sim is not None and self.vllm is not None:
            raise ValueError("a replica runs either the sim engine or vLLM, not both")
        return "sim" if self.sim is not None else "vllm" if self.vllm is not None else "model"


async def create_backend(settings: ReplicaSettings) -> EngineBackend:
    """The backend the settings name; each imports its engine only here (a sim replica never
    loads torch, and only a vLLM replica imports vLLM)."""
    name = settings.engine_name
    assert name in ENGINE_NAMES
    if name == "vllm":
        from replica.vllm_backend import VllmBackend, VllmSettings

        return await VllmBackend.create(settings.engine, VllmSettings(**settings.vllm), settings.torch_threads)
    from replica.local_backend import LocalBackend

    return await LocalBackend.create(settings.engine, settings.sim, settings.torch_threads)


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Ray Serve (tests, local use)
        return f"local-{uuid.uuid4().hex[:8]}"


class PrefixCacheReplica:
    """Deployment class; the app builder wraps it with serve.deployment(...)."""

    async def __init__(self, settings: dict) -> None:
        self.settings = ReplicaSettings.from_dict(settings)
        self.replica_id = _replica_id()
        self.backend: EngineBackend = await create_backend(self.settings)
        facts = self.backend.facts
        self.metrics = ReplicaMetrics(facts.model_id, facts.max_model_len)  # vLLM's names, through Ray
        self._gauges = asyncio.create_task(self.metrics.run_gauges(self.backend.stats))
        self.kv_pull = None  # pulls of K/V from other replicas (engines that export and import it)
        if self.backend.capabilities.kv_pull and facts.engine == "model":
            from replica import kv_pull

            self.kv_pull = kv_pull.for_replica(self.backend.engine, self.replica_id, kv_pull.KvPullConfig(self.settings.kv_pull_timeout_s))
        self.publisher: BlockPublisher | None = None
        self.draining = False
        # (steps started, steps finished) at each heartbeat: shows beats while a step runs
        self.heartbeats: collections.deque[tuple[int, int]] = collections.deque(maxlen=64)
        if self.settings.redis_url:
            self.publisher = BlockPublisher(
                PublisherConfig(
                    redis_url=self.settings.redis_url,
                    replica_id=self.replica_id,
                    key_prefix=self.settings.key_prefix,
                    depth=self.settings.publish_depth,
                ),
                snapshot=self._snapshot,
                load=self._load,
            )
            self.backend.add_listener(self.publisher)
            self.publisher.start()
        log.info("replica %s ready (%s engine, pid %d)", self.replica_id, facts.engine, os.getpid())

    @property
    def engine(self):
        """Our engines' AsyncLLMEngine (tests and replica/kv_pull.py drive it directly)."""
        return self.backend.engine

    async def _snapshot(self) -> list[tuple[int, int]]:
        """The cached set for a full resync, taken between steps (never blocks this loop)."""
        return await self.backend.block_snapshot(self.publisher.reset_events)

    def _load(self) -> dict[str, int]:
        s = self.backend.stats()  # a snapshot: answers at once even during a long step
        engine = getattr(self.backend, "engine", None)
        if engine is not None and hasattr(engine, "steps_started"):
            self.heartbeats.append((engine.steps_started, engine.steps_finished))
        else:
            self.heartbeats.append((s.steps, s.steps))
        load = {
            "running": s.running,
            "waiting": s.waiting,
            "pending_prefill_tokens": s.pending_prefill_tokens,
            "free_blocks": s.blocks_free,
            "cached_blocks": s.blocks_cached,
            "capacity_blocks": s.blocks_total,
            "kv_pull": int(self.backend.capabilities.kv_pull),  # routers send pull hints only where 1
            "pid": os.getpid(),  # lets operators (and the fault tests) find the process
            "generated_tokens": s.generated_tokens,  # tests see whether an aborted request stopped
        }
        extra = self.backend.load_extra()
        rates = {k: extra.pop(k) for k in ("kv_pull_bytes_per_s", "prefill_tokens_per_s") if k in extra}
        load.update(extra)
        return add_pull_load(load, self.kv_pull, self.backend.facts.kv_bytes_per_token, rates or None)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[dict]:
        yield {"type": "start", "replica": self.replica_id, "route": request.route}
        if self.draining:  # a late arrival: the gateway continues it on another replica
            yield {"type": "error", "code": 503, "message": "replica is shutting down", "retry": True}
            return
        rec = self.metrics.request()
        try:
            params = SamplingParams(**request.params)
            extra = {}
            if request.prefix_output_token_ids:  # a stream migrated from another replica
                extra = {"prefix_output_token_ids": request.prefix_output_token_ids,
                         "prefix_text_len": request.prefix_text_len}
            if request.kv_source is not None and self.kv_pull is not None:  # the router's pull hint
                kv = await self.kv_pull.pull(request.kv_source, request.prompt_token_ids, request.cache_salt)
                if kv is not None:
                    extra["kv_prefix"] = kv  # imported with the request's own add, on the engine thread
            if request.kv_source is not None and self.settings.sim is not None and request.kv_source.replica_id != self.replica_id:
                extra["kv_pull_blocks"] = request.kv_source.num_blocks  # modelled pull (replica/sim_engine.py)
            stream = self.backend.generate(
                request.prompt_token_ids, params, request_id=request.request_id, cache_salt=request.cache_salt, **extra
            )
            async for out in stream:
                rec.output(out)
                if out.new_token_ids or out.new_text:
                    delta = {"type": "delta", "token_ids": out.new_token_ids, "text": out.new_text}
                    if getattr(out, "logprobs", None):
                        delta["logprobs"] = out.logprobs
                    yield delta
                if out.finished:
                    if self.kv_pull is not None:
                        self.kv_pull.observe(out)
                    yield {
                        "type": "end",
                        "finish_reason": out.finish_reason,
                        "prompt_tokens": out.num_prompt_tokens,
                        "cached_tokens": out.num_cached_tokens,
                        "completion_tokens": len(out.token_ids),
                    }
        except (InvalidRequestError, TypeError, ValueError) as e:
            rec.done = True  # refused, never ran: not a finished request
            yield {"type": "error", "code": 400, "message": str(e)}
        except EngineDeadError as e:  # failed or shutting down: another replica can continue it
            yield {"type": "error", "code": 503, "message": str(e), "retry": True}
        finally:
            rec.close()  # ended without finishing (client gone, engine failed): counted as abort

    async def info(self) -> dict:
        """Model facts the gateway needs, and live stats for /health and /metrics."""
        facts = self.backend.facts
        stats = asdict(self.backend.stats())
        if self.publisher is not None:
            stats["publisher"] = asdict(self.publisher.stats)
        if self.kv_pull is not None:
            stats["kv_pull"] = asdict(self.kv_pull.snapshot())
        return {
            "replica": self.replica_id,
            "model_id": facts.model_id,
            "max_model_len": facts.max_model_len,
            "vocab_size": facts.vocab_size,
            "block_size": facts.block_size,
            "pool_tokens": facts.pool_tokens,
            "engine": facts.engine,
            "capabilities": asdict(self.backend.capabilities),
            "pid": os.getpid(),
            "torch_loaded": "torch" in sys.modules,
            "stats": stats,
            **self.backend.info_extra(),
        }

    async def export_kv(self, hashes: list[int], token_ids: list[int], first: int = 0):
        """Another replica pulling a prefix asks for these blocks (replica/kv_pull.py): the run of
        hashes[first:] held here, or None."""
        if self.kv_pull is None:
            return None
        return await self.kv_pull.export(hashes, token_ids, first)

    async def check_health(self) -> None:
        if not self.backend.alive:
            raise RuntimeError("engine stopped")

    async def __del__(self) -> None:
        """Serve calls this after draining (ongoing requests finished, or its graceful timeout
        spent): hand off what still runs, retract this replica's blocks from the index, exit."""
        await drain_replica(self)
