"""Pulling a prefix's K/V from the replica that holds it, through Ray (docs/kv-pull.md).

The router's decision carries a hint beside the request (RouteDecision.pull: holder replica
id, leading blocks). The replica taking the request asks the holder for those blocks before it queues the
request; the holder pins them on its engine thread, copies them out off that thread and
returns them; the receiver imports them into its cache (replica/kv_io/kv_transfer.py) with the
request's own add, so the engine computes only the rest. Anything that goes wrong (holder dead,
blocks evicted meanwhile, timeout, foreign shape) leaves the request to compute its prompt:
a pull can make a request faster, never fail it.

Transport: Ray's object store. The holder's method runs through its Serve replica actor
(`handle_request`, the call Serve's own handles make), addressed by replica id, so no router
policy has to cooperate; the numpy payload is read zero-copy out of the object store. Ray
Direct Transport (`tensor_transport=...`) needs an actor class declared with
`enable_tensor_transport=True`, which Serve's replica actors are not (Ray 2.60), so it is not
available to Serve replicas; TRANSPORT says which transport runs.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import pickle
import struct
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from replica.kv_io import kv_transfer
from router.protocol.hashing import block_hashes, chain_seed
from router.protocol.messages import KV_PULL_TIMEOUT_S
from router.telemetry import Metric

if TYPE_CHECKING:
    from replica.async_engine import AsyncLLMEngine
    from replica.core.engine_types import RequestOutput
    from router.protocol.messages import KvSource

log = logging.getLogger("prefixgate.replica.kv_pull")

TRANSPORT = "ray-object-store"
PULL_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PULL_BYTES_BUCKETS = tuple(float(m * 10**e) for e in range(4, 11) for m in (1, 2, 5))
OUTCOMES = ("ok", "empty", "timeout", "failed", "skipped")


@dataclass
class KvPullConfig:
    timeout_s: float = KV_PULL_TIMEOUT_S  # the whole pull (holder's pin waits for its current step); then recompute
    # the holder releases exported blocks as the next to evict: the copy on the puller is the one
    # the conversation will use (simulator: +1 point of hit rate at 8 replicas, docs/kv-pull.md)
    demote_exported: bool = True
    # a measured pull rate this old (no pull since) is dropped: the heartbeat reports 0, "not
    # measured", and the router prices pulls with its default again, so one slow pull that put
    # the rate below break-even cannot stop pulls (and so new measurements) for good
    rate_ttl_s: float = 60.0


@dataclass
class KvPullStats:
    """Counts in info()["stats"]["kv_pull"]; rates are what the heartbeat reports."""

    transport: str = TRANSPORT
    pulls: int = 0  # hints acted on (a round trip to the holder)
    ok: int = 0
    empty: int = 0  # the holder had none of the blocks any more (evicted meanwhile)
    timeouts: int = 0
    failed: int = 0  # holder dead or unreachable, or an error on its side
    skipped: int = 0  # hints needing no pull: the holder is this replica, or the blocks are here
    pulled_blocks: int = 0
    pulled_bytes: int = 0
    exports: int = 0
    exported_blocks: int = 0
    exported_bytes: int = 0
    bytes_per_s: float = 0.0  # recent pulls' bytes over their latency (moving average)
    prefill_tokens_per_s: float = 0.0  # recent requests' computed prompt tokens over prefill time
    latency_p50_s: float | None = None  # over the last pulls (up to 1,000)
    latency_p99_s: float | None = None
    last_error: str = ""


class Rate:
    """Exponentially weighted ratio of sums (amount / seconds): a slow sample weighs by its time."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.amount = 0.0
        self.seconds = 0.0

    def add(self, amount: float, seconds: float) -> None:
        if seconds <= 0:
            return
        if self.seconds == 0:
            self.amount, self.seconds = amount, seconds
        else:
            self.amount += self.alpha * (amount - self.amount)
            self.seconds += self.alpha * (seconds - self.seconds)

    @property
    def value(self) -> float:
        return self.amount / self.seconds if self.seconds > 0 else 0.0


class ReplicaCaller:
    """Calls a method of one replica of a Serve deployment, by replica id (the id in the index).

    Goes through the replica actor's `handle_request`, as Serve's own handles do, so the call
    reaches exactly that replica whatever the deployment's request router."""

    def __init__(self, deployment_id) -> None:
        self.deployment_id = deployment_id  # ray.serve's DeploymentID (name, app_name)
        self._actors: dict[str, Any] = {}

    @classmethod
    def for_this_replica(cls) -> ReplicaCaller:
        """Calls replicas of the deployment this replica belongs to; raises outside Serve."""
        from ray import serve

        return cls(serve.get_replica_context().replica_id.deployment_id)

    async def _actor(self, replica_id: str):
        actor = self._actors.get(replica_id)
        if actor is None:
            import ray
            from ray.serve._private.common import ReplicaID
            from ray.serve._private.constants import SERVE_NAMESPACE

            name = ReplicaID(replica_id, self.deployment_id).to_full_id_str()
            actor = await asyncio.to_thread(ray.get_actor, name, namespace=SERVE_NAMESPACE)
            self._actors[replica_id] = actor
        return actor

    def metadata(self, method: str, streaming: bool = False) -> bytes:
        from ray.serve._private.common import RequestMetadata

        rid = uuid.uuid4().hex
        return pickle.dumps(RequestMetadata(request_id=rid, internal_request_id=rid, call_method=method,
                                            app_name=self.deployment_id.app_name, is_streaming=streaming))

    async def call(self, replica_id: str, method: str, *args: Any) -> Any:
        """The method's result. A call given up on here (its timeout, or the client gone: the
        awaiting task cancelled) is cancelled on the replica too, so the work it asked for (a
        hand-over's prefill, a pull's copy) stops there instead of running to its end unread."""
        actor = await self._actor(replica_id)
        ref = actor.handle_request.remote(self.metadata(method), *args)
        try:
            return await ref
        except asyncio.CancelledError:
            import ray

            ray.cancel(ref)  # Serve cancels the method's task on the replica (CancelledError there)
            raise
        except Exception:
            self._actors.pop(replica_id, None)  # dead or replaced: look it up again next time
            raise


class KvPullMetrics:
    """prefixgate_kv_pull_* through Ray's metrics (replica/serve/metrics.py's conventions)."""

    def __init__(self, model_name: str) -> None:
        tags = {"model_name": model_name}
        self.pulls = Metric("counter", "prefixgate_kv_pulls", "Pull hints acted on, by outcome", ["outcome"], default_tags=tags)
        self.bytes = Metric("histogram", "prefixgate_kv_pull_bytes", "K/V bytes pulled per request",
                            buckets=PULL_BYTES_BUCKETS, default_tags=tags)
        self.latency = Metric("histogram", "prefixgate_kv_pull_latency_seconds", "Pull latency (ask to blocks received)",
                              buckets=PULL_LATENCY_BUCKETS, default_tags=tags)
        self.blocks = Metric("counter", "prefixgate_kv_pull_blocks", "Blocks pulled from other replicas", default_tags=tags)
        self.exported = Metric("counter", "prefixgate_kv_export_bytes", "K/V bytes handed to other replicas", default_tags=tags)
        for outcome in OUTCOMES:
            self.pulls.zero(outcome)
        self.blocks.zero()
        self.exported.zero()


@dataclass
class KvPuller:
    """One replica's side of pulls: asks holders, answers askers, measures both rates."""

    engine: AsyncLLMEngine
    replica_id: str
    config: KvPullConfig = field(default_factory=KvPullConfig)
    caller: ReplicaCaller | None = None  # None outside Serve: hints are skipped
    metrics: KvPullMetrics | None = None
    clock: Callable[[], float] = time.monotonic  # for the pull rate's age

    def __post_init__(self) -> None:
        self.stats = KvPullStats()
        self.pull_rate = Rate()
        self.prefill_rate = Rate()
        self.latencies: collections.deque[float] = collections.deque(maxlen=1000)
        self.last_rate_sample_at: float | None = None
        self.in_flight = 0  # pulls waiting for their holder: requests the engine has not seen yet
        self.in_flight_tokens = 0  # their prompt tokens (all computed if the pull fails)

    # ---- the receiving side ---------------------------------------------------------------
    async def pull(self, source: KvSource, prompt: list[int], cache_salt: str | None,
                   adapter: str | None = None) -> kv_transfer.KvBlocks | None:
        """The hinted blocks this replica lacks, or None (then the request computes them).
        `adapter`: the identity of the request's LoRA adapter (its blocks are keyed under it)."""
        e = self.engine.engine
        bs = e.config.block_size
        n = min(source.num_blocks, (len(prompt) - 1) // bs)
        if source.replica_id == self.replica_id or n <= 0 or self.caller is None:
            return self._outcome("skipped")
        try:
            hashes = block_hashes(prompt[: n * bs], bs, chain_seed(e.model_id, cache_salt, adapter))
        except (struct.error, TypeError, OverflowError):  # not token ids: the add refuses it (400)
            return self._outcome("skipped")
        first = 0
        held = e.blocks.hash_to_block  # a racy read is fine: it only trims what is asked for
        while first < n and hashes[first] in held:
            first += 1
        if first == n:
            return self._outcome("skipped")
        self.stats.pulls += 1
        start = time.perf_counter()
        self.in_flight += 1
        self.in_flight_tokens += len(prompt)
        try:
            kv = await asyncio.wait_for(
                self.caller.call(source.replica_id, "export_kv", hashes, prompt[: n * bs], first), self.config.timeout_s
            )
        except TimeoutError:
            self.stats.last_error = f"timeout after {self.config.timeout_s} s"
            return self._outcome("timeout")
        except Exception as err:  # holder dead, gone from Serve, engine failed: recompute
            self.stats.last_error = f"{type(err).__name__}: {err}"[:300]
            log.info("pull from %s failed: %s", source.replica_id, self.stats.last_error)
            return self._outcome("failed")
        finally:
            self.in_flight -= 1
            self.in_flight_tokens -= len(prompt)
        seconds = time.perf_counter() - start
        if kv is None or kv.num_blocks == 0:
            return self._outcome("empty")
        self.latencies.append(seconds)
        self.record_rate(kv.nbytes, seconds)
        self.stats.pulled_blocks += kv.num_blocks
        self.stats.pulled_bytes += kv.nbytes
        if self.metrics is not None:
            self.metrics.latency.observe(seconds)
            self.metrics.bytes.observe(kv.nbytes)
            self.metrics.blocks.inc(kv.num_blocks)
        self._outcome("ok")
        return kv

    def _outcome(self, outcome: str) -> None:
        counter = "timeouts" if outcome == "timeout" else outcome
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        if self.metrics is not None:
            self.metrics.pulls.labels(outcome).inc()
        return None

    # ---- the holding side -----------------------------------------------------------------
    async def export(self, hashes: list[int], token_ids: list[int], first: int) -> kv_transfer.KvBlocks | None:
        """The run of hashes[first:] held here: pinned on the engine thread, copied off it."""
        e = self.engine.engine
        block_ids = await self._pin(hashes, token_ids, first)
        if not block_ids:
            return None
        try:
            kv = await asyncio.to_thread(kv_transfer.read_blocks, e.runner.pool, block_ids, hashes[first:],
                                         e.config.block_size, first)
        finally:  # also when the asker gave up: the pins must go
            exported = hashes[first : first + len(block_ids)] if self.config.demote_exported else []

            def release(engine) -> None:
                engine.blocks.unpin(block_ids)
                engine.blocks.demote(exported)

            await asyncio.shield(self.engine.submit(release))
        self.stats.exports += 1
        self.stats.exported_blocks += kv.num_blocks
        self.stats.exported_bytes += kv.nbytes
        if self.metrics is not None:
            self.metrics.exported.inc(kv.nbytes)
        return kv

    async def _pin(self, hashes: list[int], token_ids: list[int], first: int) -> list[int]:
        """The pin, cancellation-safe: once posted it runs on the engine thread whatever happens
        to this task, so a caller cancelled meanwhile (the asker timed out) hands the block ids
        to a callback that unpins them instead of losing them, pinned forever."""
        pinning = asyncio.ensure_future(
            self.engine.submit(lambda engine: kv_transfer.pin(engine, hashes, token_ids, first))
        )
        try:
            return await asyncio.shield(pinning)
        except asyncio.CancelledError:
            pinning.add_done_callback(self._unpin_abandoned)
            raise

    def _unpin_abandoned(self, pinning: asyncio.Future) -> None:
        if pinning.cancelled() or pinning.exception() is not None:
            return  # nothing was pinned
        block_ids = pinning.result()
        if block_ids:
            self.engine.post(lambda engine: engine.blocks.unpin(block_ids))

    # ---- measurements -----------------------------------------------------------------------
    def observe(self, out: RequestOutput) -> None:
        """A finished request's prefill: computed prompt tokens over its prefill time."""
        m = out.metrics
        if m is None:
            return
        computed = m.num_prompt_tokens - m.num_cached_tokens
        if computed >= 16 and m.first_token_time is not None:
            self.prefill_rate.add(computed, m.prefill_time)

    def record_rate(self, nbytes: int, seconds: float) -> None:
        """One pull's bytes over its latency into the moving average, dated for its expiry."""
        self.pull_rate.add(nbytes, seconds)
        self.last_rate_sample_at = self.clock()

    def _expire_rate(self) -> None:
        at = self.last_rate_sample_at
        if at is not None and self.clock() - at > self.config.rate_ttl_s:
            self.pull_rate = Rate(self.pull_rate.alpha)  # 0: not measured; the next pull starts afresh
            self.last_rate_sample_at = None

    def snapshot(self) -> KvPullStats:
        self._expire_rate()
        s = self.stats
        s.bytes_per_s = round(self.pull_rate.value, 1)
        s.prefill_tokens_per_s = round(self.prefill_rate.value, 1)
        if self.latencies:
            ordered = sorted(self.latencies)
            s.latency_p50_s = ordered[len(ordered) // 2]
            s.latency_p99_s = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
        return s

    def heartbeat(self) -> dict[str, int]:
        """The Heartbeat fields (router/protocol/redis_schema.py) this replica measures."""
        self._expire_rate()
        return {"kv_pull_bytes_per_s": int(self.pull_rate.value), "prefill_tokens_per_s": int(self.prefill_rate.value)}


def for_replica(engine: AsyncLLMEngine, replica_id: str, config: KvPullConfig) -> KvPuller:
    """The puller of a Serve replica; outside Serve (local use) it answers exports but skips hints."""
    try:
        caller = ReplicaCaller.for_this_replica()
    except Exception:  # no replica context
        caller = None
    metrics = KvPullMetrics(engine.engine.model_id) if caller is not None else None
    return KvPuller(engine, replica_id, config, caller, metrics)
