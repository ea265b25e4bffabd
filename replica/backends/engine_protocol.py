"""The seam between a replica and the engine it runs: one protocol, three backends.

The replica deployment (replica/serve/deployment.py) drives an `EngineBackend` and nothing else:
our paged engine and the simulated engine (replica/backends/local_backend.py, both behind
AsyncLLMEngine) and vLLM's async engine (replica/backends/vllm_backend.py). What a backend can do
beyond streaming tokens is declared in `Capabilities`, which the gateway reads from `info()`
and the router from the heartbeat (`kv_pull`): a replica that cannot import pulled K/V is
never sent a pull hint.

Torch-free, like replica/core/engine_types.py: the gateway and the router import it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from replica.core.engine_types import EngineStats, RequestOutput
from router.protocol.events import KVEventListener
from router.protocol.lora import AdapterRef
from router.protocol.messages import GenerateRequest
from router.protocol.model_facts import ModelFacts

__all__ = ["ENGINE_NAMES", "Capabilities", "EngineBackend", "KvPullPeer", "ModelFacts"]

ENGINE_NAMES = ("model", "sim", "vllm")


@dataclass(frozen=True)
class Capabilities:
    """What a backend does beyond generate/abort/stats (each checked where it is used)."""

    kv_export: bool = False  # hands its cached blocks to a pulling replica (replica/kv_io/kv_pull.py)
    kv_import: bool = False  # takes another replica's K/V before a prefill (a pull hint)
    logprobs: bool = True
    grammar: bool = True  # response_format json_object / json_schema
    continuation: bool = True  # continues a migrated stream after prefix_output_token_ids
    lora: bool = False  # runs requests under LoRA adapters (started with adapters or enable_lora)

    @property
    def kv_pull(self) -> bool:
        """Pull hints are worth sending here (and pulling from here)."""
        return self.kv_export and self.kv_import

    def refusal(self, request: GenerateRequest) -> str | None:
        """Why a request cannot be honoured here (the field named), or None: a replica never
        silently ignores what a request asks for."""
        params = request.params
        if request.adapter is not None and not self.lora:
            return "model names a LoRA adapter, but this replica's engine was started without LoRA"
        if params.logprobs is not None and not self.logprobs:
            return "logprobs is not supported by this replica's engine"
        if (params.response_format or {}).get("type", "text") != "text" and not self.grammar:
            return "response_format is not supported by this replica's engine"
        if request.continuing and not self.continuation:
            return "prefix_output_token_ids (a migrated stream) is not supported by this replica's engine"
        return None


class KvPullPeer(Protocol):
    """A backend's side of K/V pulls that move bytes (replica/kv_io/kv_pull.py `KvPuller`): it
    pulls a hinted prefix before a request runs and exports this replica's blocks to others."""

    async def pull(self, source: Any, prompt: list[int], cache_salt: str | None, adapter: str | None = None) -> Any: ...

    async def export(self, hashes: list[int], token_ids: list[int], first: int) -> Any: ...

    def observe(self, out: RequestOutput) -> None: ...

    def snapshot(self) -> Any: ...


@runtime_checkable
class EngineBackend(Protocol):
    facts: ModelFacts
    capabilities: Capabilities

    def generate(self, request: GenerateRequest, kv_prefix: Any = None) -> AsyncIterator[RequestOutput]:
        """Stream the request's deltas; the last has finished=True. Raises InvalidRequestError
        before anything runs for a request the engine refuses, EngineDeadError when it stops.
        The request comes as the gateway built it (router/protocol/messages.py): its LoRA adapter
        (where `capabilities.lora`) is read first if new, its priority is vLLM's scheduling
        priority, a migrated stream continues after its prefix_output_token_ids, its pull hint is
        modelled where the backend models pulls. `kv_prefix`: the K/V a pull brought, where the
        backend imports it (replica/kv_io/kv_transfer.py `KvBlocks`)."""
        ...

    def pull_peer(self, replica_id: str, timeout_s: float) -> KvPullPeer | None:
        """The peer that moves K/V bytes for this replica's pulls and exports, or None where
        this backend does not (the sim engine models pulls, vLLM's does not pull)."""
        ...

    def step_progress(self) -> tuple[int, int]:
        """(steps started, steps finished): the heartbeat records them to show that it goes on
        while a long step runs (tests/test_replica_loop.py)."""
        ...

    async def add_adapter(self, adapter: AdapterRef) -> None:
        """Read and check a LoRA adapter now (InvalidRequestError says why it cannot be served)."""

    def abort(self, request_id: str) -> None:
        """Stop a request and free what it holds; returns at once."""

    def stats(self) -> EngineStats:
        """A snapshot that never waits for a step: the heartbeat's load."""
        ...

    def load_extra(self) -> dict[str, int | float]:
        """Backend-specific heartbeat fields (modelled pull rates, step lag)."""
        ...

    def info_extra(self) -> dict[str, Any]:
        """Backend-specific facts for `info()` (the sim engine's step lag, vLLM's version)."""
        ...

    def add_listener(self, listener: KVEventListener) -> None:
        """Where this backend's block events go (the publisher to the index)."""

    def block_snapshot(self, reset_events: Callable[[], None]) -> Awaitable[list[tuple[int, int, str]]]:
        """(our hash, position, medium) of every block held in any tier, for a full resync; `reset_events` is
        called atomically with taking it, so no event is both in it and queued after it."""
        ...

    async def hand_off(self, reason: str) -> int:
        """End every in-flight request with EngineDeadError(reason) so the gateway continues it
        on another replica; returns how many there were."""
        ...

    def shutdown(self) -> None: ...

    @property
    def alive(self) -> bool: ...
