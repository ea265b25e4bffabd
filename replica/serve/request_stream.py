"""One request on a replica, as the chunks the gateway reads (router/protocol/messages.py).

The request is re-validated as it enters (a malformed one is a 400 chunk, never half-run);
the router's decision arrives beside it (`route`) and its hand-over from a prefill replica or
its pull hint, if any, runs before the engine sees the request; the engine's outputs go out in batches (replica/serve/stream_batcher.py),
and while the engine works without output, keepalives go out so the gateway's stall guard can
tell slow from frozen.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol

import msgspec

from replica.async_engine import EngineDeadError
from replica.backends.engine_protocol import EngineBackend, KvPullPeer
from replica.core.engine_types import InvalidRequestError, UnknownAdapterError
from replica.serve.audit import outcome
from replica.serve.keepalive import with_keepalive
from replica.serve.stream_batcher import batched_outputs
from router.protocol.audit_log import AuditWriter, now
from router.protocol.messages import (
    KEEPALIVE_S,
    AliveChunk,
    Chunk,
    DeltaChunk,
    EndChunk,
    ErrorChunk,
    GenerateRequest,
    KvSource,
    RouteDecision,
    StartChunk,
    checked_request,
)


class StreamHost(Protocol):
    """What a request's stream reads of the replica that runs it (replica/serve/deployment.py)."""

    replica_id: str
    draining: bool
    backend: EngineBackend
    metrics: Any  # ReplicaMetrics
    kv_pull: KvPullPeer | None  # moves pulled K/V bytes, where the backend does
    handover: Any  # a decode replica's hand-overs from prefill replicas (replica/kv_io/handover.py), else None
    settings: Any  # ReplicaSettings
    audit: AuditWriter | None  # the live routing audit's file, where it is on


async def request_chunks(replica: StreamHost, request: Any, route: RouteDecision | None) -> AsyncIterator[Chunk]:
    yield StartChunk(replica.replica_id, route)
    if replica.draining:  # a late arrival: the gateway continues it on another replica
        yield ErrorChunk(503, "replica is shutting down", retry=True)
        return
    rec = replica.metrics.request()
    try:
        try:
            request = checked_request(request)
        except (msgspec.MsgspecError, TypeError, ValueError) as e:
            raise InvalidRequestError(f"malformed request: {e}") from e
        refused = replica.backend.capabilities.refusal(request)
        if refused is not None:
            raise InvalidRequestError(refused)
        request.pull = _pull_hint(replica, route)
        kv_prefix = None
        prep_kv = None  # what brings K/V before the engine sees the request: a hand-over, else a pull
        prefill = route.prefill if route is not None and replica.handover is not None else None
        if prefill is not None and prefill.replica_id != replica.replica_id:
            prep_kv = replica.handover.run(prefill, request, replica.backend.facts.model_id)
        elif request.pull is not None and replica.kv_pull is not None:
            prep_kv = _pull(replica, request)
        if prep_kv is not None:
            # a pull can take up to kv_pull_timeout_s, a hand-over a prefill elsewhere: keepalives go out meanwhile
            async with contextlib.aclosing(with_keepalive(_once(prep_kv), KEEPALIVE_S)) as prep:
                async for got in prep:
                    if got is None:
                        yield AliveChunk()
                    else:
                        kv_prefix = got
        stream = replica.backend.generate(request, kv_prefix)
        batched = batched_outputs(stream, replica.settings.stream_interval_s, KEEPALIVE_S)
        first_token_t = None
        async with contextlib.aclosing(batched) as outputs:
            async for out in outputs:
                if out is None:  # nothing new for a while: tell the gateway's stall guard we are here
                    yield AliveChunk()
                    continue
                rec.output(out)
                if out.new_token_ids or out.new_text:
                    if first_token_t is None and replica.audit is not None:
                        first_token_t = now()
                    yield DeltaChunk(out.new_token_ids, out.new_text, getattr(out, "logprobs", None) or None)
                if out.finished:
                    if replica.kv_pull is not None:
                        replica.kv_pull.observe(out)
                    if replica.audit is not None:
                        outcome(replica.audit, replica.replica_id, request.request_id, out.num_prompt_tokens,
                                out.num_cached_tokens, first_token_t)
                    yield EndChunk(out.finish_reason, out.num_prompt_tokens, out.num_cached_tokens, len(out.token_ids))
    except (InvalidRequestError, ValueError) as e:  # ValueError: vLLM's refusal (a TypeError is our bug: a 500)
        rec.done = True  # refused, never ran: not a finished request
        yield ErrorChunk(404 if isinstance(e, UnknownAdapterError) else 400, str(e))
    except EngineDeadError as e:  # failed or shutting down: another replica can continue it
        yield ErrorChunk(503, str(e), retry=True)
    finally:
        rec.close()  # ended without finishing (client gone, engine failed): counted as abort


async def _once(awaitable: Awaitable[Any]) -> AsyncIterator[Any]:
    yield await awaitable


def _pull_hint(replica: StreamHost, route: RouteDecision | None) -> KvSource | None:
    """The router's pull hint as this replica acts on it: none when the holder is itself."""
    pull = route.pull if route is not None else None
    return pull if pull is not None and pull.num_blocks and pull.replica_id != replica.replica_id else None


async def _pull(replica: StreamHost, request: GenerateRequest) -> Any:
    """The hinted prefix's K/V from its holder, where this replica's backend moves bytes (None:
    the holder did not answer in time or no longer holds it; the prompt is computed)."""
    adapter = request.adapter.identity if request.adapter is not None else None
    return await replica.kv_pull.pull(request.pull, request.prompt_token_ids, request.cache_salt, adapter)
