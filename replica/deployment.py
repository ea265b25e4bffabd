"""The Ray Serve replica: one AsyncLLMEngine plus the publisher of its block hashes."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from replica.async_engine import AsyncLLMEngine, EngineDeadError
from replica.drain import drain_replica
from replica.engine_types import EngineConfig, InvalidRequestError
from replica.metrics import ReplicaMetrics
from replica.publisher import BlockPublisher, PublisherConfig
from replica.pull_load import add_pull_load
from replica.sampling_params import SamplingParams
from router.protocol.messages import GenerateRequest

if TYPE_CHECKING:  # imported lazily: only a replica running the real model loads torch
    from replica.engine import LLMEngine

log = logging.getLogger("prefixgate.replica")


@dataclass
class ReplicaSettings:
    engine: EngineConfig = field(default_factory=EngineConfig)
    redis_url: str | None = None  # None: run without publishing (routing falls back to hashing)
    key_prefix: str = "prefixgate"
    publish_depth: int = 64
    torch_threads: int = 1
    sim: dict | None = None  # SimEngineConfig fields: a simulated-compute replica (no model, no torch)
    kv_pull_timeout_s: float = 5.0  # a pull hint's round trip (docs/kv-pull.md); past it: recompute

    @classmethod
    def from_dict(cls, d: dict) -> ReplicaSettings:
        d = dict(d)
        engine = EngineConfig(**d.pop("engine", {}))
        return cls(engine=engine, **d)

    def to_dict(self) -> dict:
        return asdict(self)


def kv_bytes_per_token(engine) -> int:
    """K/V bytes one token occupies: the sim engine's modelled figure, or the real pool's
    (k + v over its slots); 0 when unknown. The router prices pulls with it."""
    modelled = getattr(getattr(engine, "config", None), "kv_bytes_per_token", None)
    if modelled is not None:
        return int(modelled)
    pool = getattr(getattr(engine, "runner", None), "pool", None)
    if pool is None:
        return 0
    return int((pool.k.nbytes + pool.v.nbytes) // pool.k.shape[2])


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
        if self.settings.sim is not None:
            from replica.sim_engine import SimEngine, SimEngineConfig

            engine = SimEngine(SimEngineConfig(**self.settings.sim))
        else:
            import torch

            from replica.engine import LLMEngine

            torch.set_num_threads(self.settings.torch_threads)
            engine = await asyncio.to_thread(LLMEngine, config=self.settings.engine)
        self.engine = AsyncLLMEngine(engine)
        self.metrics = ReplicaMetrics(engine.model_id, engine.max_model_len)  # vLLM's names, through Ray
        self._gauges = asyncio.create_task(self.metrics.run_gauges(self.engine.stats))
        self.kv_pull = None  # pulls of K/V from other replicas (real engines only)
        if self.settings.sim is None:
            from replica import kv_pull

            self.kv_pull = kv_pull.for_replica(self.engine, self.replica_id, kv_pull.KvPullConfig(self.settings.kv_pull_timeout_s))
        self.kv_bytes_per_token = kv_bytes_per_token(engine)  # reported for the router's pull pricing
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
            engine.add_listener(self.publisher)
            self.publisher.start()
        log.info("replica %s ready (pid %d)", self.replica_id, os.getpid())

    async def _snapshot(self) -> list[tuple[int, int]]:
        """The cached set for a full resync, taken between steps (never blocks this loop)."""

        def take(engine: LLMEngine):
            self.publisher.reset_events()
            return engine.blocks.cached_hashes()

        return await self.engine.submit(take)

    def _load(self) -> dict[str, int]:
        s = self.engine.stats()  # a snapshot: answers at once even during a long step
        self.heartbeats.append((self.engine.steps_started, self.engine.steps_finished))
        load = {
            "running": s.running,
            "waiting": s.waiting,
            "pending_prefill_tokens": s.pending_prefill_tokens,
            "free_blocks": s.blocks_free,
            "cached_blocks": s.blocks_cached,
            "capacity_blocks": s.blocks_total,
            "pid": os.getpid(),  # lets operators (and the fault tests) find the process
            "generated_tokens": s.generated_tokens,  # tests see whether an aborted request stopped
        }
        lag = getattr(self.engine.engine, "lag", None)  # sim replica: the fleet harness reads every replica's
        if lag is not None and lag.modelled_s > 0:
            load["step_lag"] = round(lag.actual_s / lag.modelled_s - 1, 4)  # time-weighted, since start
        pull_rates = getattr(self.engine.engine, "pull_rates", None)  # sim engine: its modelled rates
        return add_pull_load(load, self.kv_pull, self.kv_bytes_per_token, pull_rates() if pull_rates else None)

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
            stream = self.engine.generate(
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
        e = self.engine.engine
        stats = asdict(self.engine.stats())
        if self.publisher is not None:
            stats["publisher"] = asdict(self.publisher.stats)
        if self.kv_pull is not None:
            stats["kv_pull"] = asdict(self.kv_pull.snapshot())
        return {
            "replica": self.replica_id,
            "model_id": e.model_id,
            "max_model_len": e.max_model_len,
            "vocab_size": e.vocab_size,
            "block_size": e.config.block_size,
            "pool_tokens": e.blocks.num_blocks * e.config.block_size,
            "engine": "sim" if self.settings.sim is not None else "model",
            "step_lag": e.step_lag() if hasattr(e, "step_lag") else None,
            "pid": os.getpid(),
            "torch_loaded": "torch" in sys.modules,
            "stats": stats,
        }

    async def export_kv(self, hashes: list[int], token_ids: list[int], first: int = 0):
        """Another replica pulling a prefix asks for these blocks (replica/kv_pull.py): the run of
        hashes[first:] held here, or None."""
        if self.kv_pull is None:
            return None
        return await self.kv_pull.export(hashes, token_ids, first)

    async def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError("engine loop thread died")

    async def __del__(self) -> None:
        """Serve calls this after draining (ongoing requests finished, or its graceful timeout
        spent): hand off what still runs, retract this replica's blocks from the index, exit."""
        await drain_replica(self)
