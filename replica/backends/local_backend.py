"""Our own engines behind the seam: the paged engine (`model`) and the simulated one (`sim`).

Both run on AsyncLLMEngine's step thread; the real engine exports and imports K/V for pulls,
the simulated one models pulls (its heartbeat carries the modelled rates) and imports no torch.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from replica.async_engine import AsyncLLMEngine
from replica.backends.engine_protocol import Capabilities, ModelFacts
from replica.core.engine_types import EngineStats, RequestOutput
from replica.engine_config import EngineConfig
from replica.kvcache.block_manager import KVEventListener
from router.protocol.lora import AdapterRef
from router.protocol.sampling import SamplingParams


def kv_bytes_per_token(engine) -> int:
    """K/V bytes one token occupies: the sim engine's modelled figure, or the real pool's
    (k + v over its slots); 0 when unknown. The router prices pulls with it."""
    modelled = getattr(engine.config, "kv_bytes_per_token", None)
    if modelled is not None:
        return int(modelled)
    pool = engine.runner.pool
    return int((pool.k.nbytes + pool.v.nbytes) // pool.k.shape[2])


class LocalBackend:
    """An LLMEngine or SimEngine on its own step thread."""

    def __init__(self, engine, name: str) -> None:
        self.engine = AsyncLLMEngine(engine)  # tests and replica/kv_io/kv_pull.py reach the engine here
        self.facts = ModelFacts(
            engine=name, model_id=engine.model_id, max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size, block_size=engine.config.block_size,
            num_blocks=engine.blocks.num_blocks, kv_bytes_per_token=kv_bytes_per_token(engine),
        )
        real = name == "model"  # the sim engine models pulls (its heartbeat carries modelled rates)
        self.capabilities = Capabilities(kv_export=True, kv_import=True, logprobs=real, grammar=real,
                                         lora=engine.adapter_slots is not None)

    @classmethod
    async def create(cls, engine_config: EngineConfig, sim: dict | None, torch_threads: int) -> LocalBackend:
        if sim is not None:
            from replica.backends.sim_engine import SimEngine
            from replica.engine_config import SimEngineConfig

            return cls(SimEngine(SimEngineConfig(**sim)), "sim")
        import torch

        from replica.engine import LLMEngine

        torch.set_num_threads(torch_threads)
        return cls(await asyncio.to_thread(LLMEngine, config=engine_config), "model")

    def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str,
                 cache_salt: str | None = None, adapter: AdapterRef | None = None, priority: int = 0,
                 **extra: Any) -> AsyncIterator[RequestOutput]:
        if adapter is None:
            return self.engine.generate(prompt_token_ids, params, request_id=request_id, cache_salt=cache_salt,
                                        priority=priority, **extra)
        return self._generate_adapter(adapter, prompt_token_ids, params, request_id, cache_salt,
                                      {**extra, "priority": priority})

    async def _generate_adapter(self, adapter: AdapterRef, prompt_token_ids, params, request_id, cache_salt,
                                extra: dict) -> AsyncIterator[RequestOutput]:
        """Under a LoRA adapter, read from its directory first if this replica lacks it (one
        loaded at run time, or on a replica started since). An adapter already served costs no
        round trip to the step thread (a dict read; the add re-checks there)."""
        if self.engine.engine.adapters.get(adapter.name) != adapter:
            await self.engine.submit(lambda engine: serve_adapter(engine, adapter))
        stream = self.engine.generate(prompt_token_ids, params, request_id=request_id, cache_salt=cache_salt,
                                      adapter=adapter.name, **extra)
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

    def load_extra(self) -> dict[str, int | float]:
        e = self.engine.engine
        extra: dict[str, int | float] = {}
        lag = getattr(e, "lag", None)  # sim engine: the fleet harness reads every replica's
        if lag is not None and lag.modelled_s > 0:
            extra["step_lag"] = round(lag.actual_s / lag.modelled_s - 1, 4)  # time-weighted, since start
        if hasattr(e, "pull_rates"):  # sim engine: its modelled rates
            extra.update(e.pull_rates())
        return extra

    def info_extra(self) -> dict[str, Any]:
        e = self.engine.engine
        return {"step_lag": e.step_lag() if hasattr(e, "step_lag") else None}

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


def serve_adapter(engine, adapter: AdapterRef) -> None:
    """`adapter` served by `engine` (on its step thread), read if it is new or changed."""
    if engine.adapters.get(adapter.name) != adapter:
        engine.add_adapter(adapter)
