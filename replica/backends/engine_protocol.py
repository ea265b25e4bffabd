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

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from replica.core.engine_types import EngineStats, RequestOutput
from replica.kvcache.block_manager import KVEventListener
from router.protocol.lora import AdapterRef
from router.protocol.sampling import SamplingParams

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

    def refusal(self, params: SamplingParams, continuing: bool, adapter: bool = False) -> str | None:
        """Why a request cannot be honoured here (the field named), or None: a replica never
        silently ignores what a request asks for."""
        if adapter and not self.lora:
            return "model names a LoRA adapter, but this replica's engine was started without LoRA"
        if params.logprobs is not None and not self.logprobs:
            return "logprobs is not supported by this replica's engine"
        if (params.response_format or {}).get("type", "text") != "text" and not self.grammar:
            return "response_format is not supported by this replica's engine"
        if continuing and not self.continuation:
            return "prefix_output_token_ids (a migrated stream) is not supported by this replica's engine"
        return None


@dataclass(frozen=True)
class ModelFacts:
    """What `info()` tells the gateway: the contract its tokeniser and limits are built on."""

    engine: str  # one of ENGINE_NAMES
    model_id: str  # served name, and the identity in block hashes
    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int  # the whole K/V pool of this replica
    kv_bytes_per_token: int = 0  # 0: unknown; the router prices pulls with it

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.block_size


@runtime_checkable
class EngineBackend(Protocol):
    facts: ModelFacts
    capabilities: Capabilities

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
        adapter: AdapterRef | None = None,
        priority: int = 0,
        **extra: Any,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's deltas; the last has finished=True. Raises InvalidRequestError
        before anything runs for a request the engine refuses, EngineDeadError when it stops.
        `adapter`: the LoRA adapter to run under (where `capabilities.lora`), read first if new.
        `priority`: vLLM's scheduling priority (lower first), the gateway's service tier.
        `extra`: prefix_output_token_ids/prefix_text_len (a migrated stream), kv_prefix (pulled
        K/V), kv_pull_blocks (a modelled pull) where the capabilities say so."""
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
