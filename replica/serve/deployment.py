"""The Ray Serve replica actor: one engine backend (replica/backends/engine_protocol.py), the publisher of
its block hashes and heartbeat, and its K/V-pull peer. Which backend runs is the one engine its
settings carry (`ReplicaSettings.engine`, decoded and checked on entry, replica/serve/replica_settings.py);
a request's stream is replica/serve/request_stream.py, the heartbeat replica/serve/heartbeat.py."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict

import msgspec

from replica.backends.engine_protocol import EngineBackend
from replica.core.engine_types import InvalidRequestError
from replica.kv_io import handover
from replica.kv_io.handover import HandoverResult, prefill_and_export
from replica.serve.audit import AuditListener
from replica.serve.drain import drain_replica
from replica.serve.heartbeat import build_heartbeat
from replica.serve.metrics import ReplicaMetrics
from replica.serve.publisher import BlockPublisher, PublisherConfig
from replica.serve.replica_settings import ReplicaSettings, create_backend
from replica.serve.request_stream import request_chunks
from router.protocol.audit_log import AuditWriter
from router.protocol.lora import AdapterRef
from router.protocol.messages import RouteDecision, checked_request, encode_chunk
from router.protocol.redis_schema import Heartbeat

log = logging.getLogger("prefixgate.replica")


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Ray Serve (tests, local use)
        return f"local-{uuid.uuid4().hex[:8]}"


class PrefixCacheReplica:
    """Deployment class; the app builder wraps it with serve.deployment(...)."""

    async def __init__(self, settings: dict, prefill: object = None) -> None:
        """`prefill`: a decode replica's handle to its prefill deployment, bound so that Serve
        deploys it; hand-overs address its replicas by id (replica/kv_io/handover.py)."""
        self.settings = ReplicaSettings.from_dict(settings)
        self.replica_id = _replica_id()
        self.backend: EngineBackend = await create_backend(self.settings)
        facts = self.backend.facts
        self.metrics = ReplicaMetrics(facts.model_id, facts.max_model_len)  # vLLM's names, through Ray
        self._gauges = asyncio.create_task(self.metrics.run_gauges(self.backend.stats))
        # pulls of K/V bytes from other replicas, and exports to theirs (None where the backend moves none)
        self.kv_pull = self.backend.pull_peer(self.replica_id, self.settings.kv_pull_timeout_s)
        # a decode replica's hand-overs from the prefill replicas (replica/kv_io/handover.py)
        self.handover = (handover.for_replica(self.backend, self.kv_pull, self.settings.prefill_deployment,
                                              self.settings.handover_timeout_s)
                         if self.settings.role == "decode" else None)
        self.publisher: BlockPublisher | None = None
        self.draining = False
        # (steps started, steps finished) at each heartbeat: shows beats while a step runs
        self.heartbeats: collections.deque[tuple[int, int]] = collections.deque(maxlen=64)
        # the live routing audit (docs/routing-audit.md): block events and outcomes, this replica's own file
        self.audit = (AuditWriter.for_process(self.settings.audit_dir, "replica", self.replica_id)
                      if self.settings.audit_dir else None)
        if self.audit is not None:
            self.backend.add_listener(AuditListener(self.audit, self.replica_id, self.settings.publish_depth))
        if self.settings.redis_url:
            self.publisher = BlockPublisher(
                PublisherConfig(
                    redis_url=self.settings.redis_url,
                    replica_id=self.replica_id,
                    key_prefix=self.settings.key_prefix,
                    depth=self.settings.publish_depth,
                    buckets=self.settings.index_buckets,
                ),
                snapshot=self._snapshot,
                load=self._load,
            )
            self.backend.add_listener(self.publisher)
            self.publisher.start()
        log.info("replica %s ready (%s engine, pid %d)", self.replica_id, facts.engine, os.getpid())

    async def _snapshot(self) -> list[tuple[int, int, str]]:
        """The cached set for a full resync, taken between steps (never blocks this loop)."""
        return await self.backend.block_snapshot(self.publisher.reset_events)

    def _load(self) -> Heartbeat:
        return build_heartbeat(self.backend, self.kv_pull, self.heartbeats,
                               self.handover.in_flight if self.handover is not None else 0)

    async def generate(self, request: object, route: RouteDecision | None = None) -> AsyncIterator[bytes]:
        """The request's chunks, msgpack-encoded (the gateway decodes them with their types).
        `route` is our router's decision, passed beside the request (absent under Ray's routers)."""
        self._load_changed()
        try:
            async with contextlib.aclosing(request_chunks(self, request, route)) as chunks:
                async for chunk in chunks:  # closed at once when Serve stops us: the engine aborts the request
                    yield encode_chunk(chunk)
        finally:
            self._load_changed()

    def _load_changed(self) -> None:
        """Routers price this replica's load from its heartbeat: a request arriving or leaving
        has it written at the next flush instead of up to a heartbeat period later."""
        if self.publisher is not None:
            self.publisher.load_changed()

    async def info(self) -> dict:
        """Model facts the gateway needs, and live stats for /health and /metrics."""
        facts = self.backend.facts
        stats = asdict(self.backend.stats())
        if self.publisher is not None:
            stats["publisher"] = asdict(self.publisher.stats)
        if self.kv_pull is not None:
            stats["kv_pull"] = asdict(self.kv_pull.snapshot())
        if self.handover is not None:
            stats["handover"] = asdict(self.handover.stats)
        return {
            "replica": self.replica_id,
            "role": self.settings.role,
            **facts.as_info(),
            "capabilities": asdict(self.backend.capabilities),
            "pid": os.getpid(),
            "torch_loaded": "torch" in sys.modules,
            "stats": stats,
            **self.backend.info_extra(),
        }

    async def export_kv(self, hashes: list[int], token_ids: list[int], first: int = 0):
        """Another replica pulling a prefix asks for these blocks (replica/kv_io/kv_pull.py): the run of
        hashes[first:] held here, or None."""
        if self.kv_pull is None:
            return None
        return await self.kv_pull.export(hashes, token_ids, first)

    async def prefill_kv(self, request: object, first: int = 0) -> HandoverResult:
        """A decode replica hands over a prompt (replica/kv_io/handover.py): computed here, its
        blocks from `first` on copied out. Raises on a request this replica cannot run (the
        decode replica then computes it)."""
        request = checked_request(request)
        refused = self.backend.capabilities.refusal(request)
        if refused is not None:
            raise InvalidRequestError(refused)
        self._load_changed()
        try:
            return await prefill_and_export(self.backend, self.kv_pull, request, first)
        finally:
            self._load_changed()

    async def add_adapter(self, adapter: object) -> str | None:
        """Read and check a LoRA adapter here (the gateway's run-time load): None when it is
        served, else why not (its tensors against the model, its rank, its files)."""
        if not self.backend.capabilities.lora:
            return "this replica's engine was started without LoRA (--enable-lora true)"
        try:
            await self.backend.add_adapter(msgspec.convert(msgspec.to_builtins(adapter), AdapterRef))
        except (InvalidRequestError, msgspec.ValidationError) as e:
            return str(e)
        return None

    async def check_health(self) -> None:
        if not self.backend.alive:
            raise RuntimeError("engine stopped")

    async def __del__(self) -> None:
        """Serve calls this after draining (ongoing requests finished, or its graceful timeout
        spent): hand off what still runs, retract this replica's blocks from the index, exit."""
        await drain_replica(self)
