"""Our own engines behind the seam: the paged engine (`model`) and the simulated one (`sim`).

Both run on AsyncLLMEngine's step thread (`LocalBackend`); `ModelBackend` exports and imports
K/V for pulls, `SimBackend` models pulls (its heartbeat carries the modelled rates) and imports
no torch. Which one runs is the factory's choice (replica/serve/replica_settings.py).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from replica.async_engine import AsyncLLMEngine
from replica.backends.engine_protocol import Capabilities, KvPullPeer, ModelFacts
from replica.core.engine_types import EngineStats, RequestOutput
from replica.engine_config import EngineConfig
from router.protocol.events import KVEventListener
from router.protocol.lora import AdapterRef
from router.protocol.messages import GenerateRequest


class LocalBackend(abc.ABC):
    """An engine of ours (LLMEngine or SimEngine) on its own step thread: what both share.
    `ModelBackend` and `SimBackend` below say what differs (the abstract methods), so nothing
    here asks which it is."""

    name = ""  # one of ENGINE_NAMES, set by each subclass

    def __init__(self, engine) -> None:
        self.engine = AsyncLLMEngine(engine)  # replica/kv_io/kv_pull.py and engine tests drive it directly
        self.facts = ModelFacts(
            engine=self.name, model_id=engine.model_id, max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size, block_size=engine.config.block_size,
            num_blocks=engine.blocks.num_blocks, kv_bytes_per_token=self._kv_bytes_per_token(engine),
        )
        self.capabilities = self._capabilities(engine)

    @abc.abstractmethod
    def _kv_bytes_per_token(self, engine) -> int:
        """K/V bytes one token occupies (the router prices pulls with it)."""

    @abc.abstractmethod
    def _capabilities(self, engine) -> Capabilities:
        """What this engine does beyond streaming tokens (engine_protocol.Capabilities)."""

    def generate(self, request: GenerateRequest, kv_prefix: Any = None) -> AsyncIterator[RequestOutput]:
        if request.adapter is None:
            return self.engine.generate(request, kv_prefix)
        return self._generate_adapter(request, kv_prefix)

    async def _generate_adapter(self, request: GenerateRequest, kv_prefix: Any) -> AsyncIterator[RequestOutput]:
        """Under a LoRA adapter, read from its directory first if this replica lacks it (one
        loaded at run time, or on a replica started since). An adapter already served costs no
        round trip to the step thread (a dict read; the add re-checks there)."""
        adapter = request.adapter
        if self.engine.engine.adapters.get(adapter.name) != adapter:
            await self.engine.submit(lambda engine: serve_adapter(engine, adapter))
        stream = self.engine.generate(request, kv_prefix)
        async with contextlib.aclosing(stream) as outputs:
            async for out in outputs:
                yield out

    async def add_adapter(self, adapter: AdapterRef) -> None:
        """Read and check `adapter` now (InvalidRequestError says why it cannot be served)."""
        await self.engine.submit(lambda engine: serve_adapter(engine, adapter))

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def step_progress(self) -> tuple[int, int]:
        return self.engine.steps_started, self.engine.steps_finished

    def pull_peer(self, replica_id: str, timeout_s: float) -> KvPullPeer | None:
        return None

    def load_extra(self) -> dict[str, int | float]:
        return {}

    def info_extra(self) -> dict[str, Any]:
        return {"step_lag": None}

    def add_listener(self, listener: KVEventListener) -> None:
        self.engine.engine.add_listener(listener)

    async def block_snapshot(self, reset_events: Callable[[], None]) -> list[tuple[int, int, str]]:
        def take(engine) -> list[tuple[int, int, str]]:  # between steps: no event can slip in between
            reset_events()
            return engine.blocks.held_blocks()

        return await self.engine.submit(take)

    async def hand_off(self, reason: str) -> int:
        return await self.engine.hand_off(reason)

    def shutdown(self) -> None:
        self.engine.shutdown()

    @property
    def alive(self) -> bool:
        return self.engine.alive


class ModelBackend(LocalBackend):
    """Our paged engine: real K/V, exported to and imported from other replicas' pulls."""

    name = "model"

    @classmethod
    async def create(cls, engine_config: EngineConfig, torch_threads: int) -> ModelBackend:
        import torch

        from replica.engine import LLMEngine

        torch.set_num_threads(torch_threads)
        return cls(await asyncio.to_thread(LLMEngine, config=engine_config))

    def _kv_bytes_per_token(self, engine) -> int:
        pool = engine.runner.pool  # k + v over the pool's slots
        return int((pool.k.nbytes + pool.v.nbytes) // pool.k.shape[2])

    def _capabilities(self, engine) -> Capabilities:
        return Capabilities(kv_export=True, kv_import=True, lora=engine.adapter_slots is not None)

    def pull_peer(self, replica_id: str, timeout_s: float) -> KvPullPeer | None:
        from replica.kv_io import kv_pull

        return kv_pull.for_replica(self.engine, replica_id, kv_pull.KvPullConfig(timeout_s))


class SimBackend(LocalBackend):
    """The simulated engine: no torch, no model; pulls and steps are modelled, and its heartbeat
    carries the modelled pull rates and how far its steps lag the model."""

    name = "sim"

    @classmethod
    async def create(cls, config: Any) -> SimBackend:
        """`config`: the replica's SimEngineConfig (replica/backends/sim_spec.py SimEngineSettings)."""
        from replica.backends.sim_engine import SimEngine

        return cls(SimEngine(config))

    def _kv_bytes_per_token(self, engine) -> int:
        return int(engine.config.kv_bytes_per_token)  # modelled

    def _capabilities(self, engine) -> Capabilities:
        # it models pulls (so routers send it hints), but has no logits or grammar to honour
        return Capabilities(kv_export=True, kv_import=True, logprobs=False, grammar=False,
                            lora=engine.adapter_slots is not None)

    def load_extra(self) -> dict[str, int | float]:
        e = self.engine.engine
        extra: dict[str, int | float] = dict(e.pull_rates())
        if e.lag.modelled_s > 0:  # the fleet harness reads every replica's, time-weighted since start
            extra["step_lag"] = round(e.lag.actual_s / e.lag.modelled_s - 1, 4)
        return extra

    def info_extra(self) -> dict[str, Any]:
        return {"step_lag": self.engine.engine.step_lag()}


def serve_adapter(engine, adapter: AdapterRef) -> None:
    """`adapter` served by `engine` (on its step thread), read if it is new or changed."""
    if engine.adapters.get(adapter.name) != adapter:
        engine.add_adapter(adapter)
