"""The prefill/decode hand-over between replicas of one model (docs/prefill-decode.md).

The router's decision names a prefill replica beside the decode replica it chose
(RouteDecision.prefill, router/prefill_pick.py). The decode replica, before its engine sees the
request, asks that prefill replica to compute the prompt and hand its K/V over, in one call
through Ray (the prefill replica's Serve actor, addressed by replica id as K/V pulls address
theirs: replica/kv_io/kv_pull.py ReplicaCaller):

  prefill side  `prefill_and_export`: the prompt runs on its engine as a request of one output
                token (so every full block of the prompt is computed and cached, and the index
                learns them), then the blocks the decode replica lacks are pinned, copied out and
                unpinned (KvPuller.export: the pins go whatever happens to the call), and the
                copy is the call's result, in Ray's object store
  decode side   `Handover.run`: the blocks come back as a pull's do and enter the request's own
                add (our engine); the sim engine, which moves no bytes, models their transfer
                as a pull hint from the prefill replica. The engine computes the prompt's last
                token and decodes from there.
  on vLLM       its own KV connector moves the K/V (replica/backends/vllm_connector.py): the
                prefill replica's vLLM saves the prompt's K/V as it computes it, its answer
                carries vLLM's `kv_transfer_params` (no bytes through Ray), and the decode
                replica's vLLM loads them with `do_remote_prefill` (ConnectorKv).

Blocks are pinned on the prefill replica only while they are copied: once in the object store,
the decode replica owns its copy, and the prefill replica's cached blocks are ordinary cache
(demoted as exported blocks are: the next to evict). Anything that goes wrong (the prefill
replica dead, gone from Serve, slower than `timeout_s`, its blocks evicted before the copy, a
foreign shape) leaves the decode replica to compute the prompt itself: the client sees one
stream, nothing is lost, and the outcome is counted (prefixgate_pd_handovers_total).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from router.protocol.hashing import block_hashes, chain_seed
from router.protocol.messages import HANDOVER_TIMEOUT_S, GenerateRequest, KvSource
from router.protocol.sampling import SamplingParams
from router.telemetry import Metric

if TYPE_CHECKING:
    from replica.kv_io.kv_pull import KvPuller, ReplicaCaller

log = logging.getLogger("prefixgate.replica.handover")

OUTCOMES = ("ok", "empty", "timeout", "failed")
SWEEP_AFTER_S = 300.0  # vLLM: a hand-over's files left this long (at least) are a given-up hand-over's
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def prefill_request(request: GenerateRequest) -> GenerateRequest:
    """What the prefill replica runs: the prompt under the same identity (tenant salt, adapter:
    the blocks hash as the decode replica's), one output token, nothing else asked of it."""
    return GenerateRequest(prompt_token_ids=request.prompt_token_ids, params=SamplingParams(max_tokens=1, ignore_eos=True),
                           request_id=f"{request.request_id}-prefill", cache_salt=request.cache_salt,
                           adapter=request.adapter, priority=request.priority)


@dataclass
class HandoverResult:
    """The prefill side's answer: the K/V bytes (our engine; None where the engine moves none, or
    none of the blocks were still held) and the prompt's blocks it computed. On vLLM the bytes
    go through its KV connector instead, and `kv_transfer_params` is what vLLM's prefill request
    returned for the decode replica's vLLM to load them (replica/backends/vllm_connector.py)."""

    kv: Any
    num_blocks: int
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class ConnectorKv:
    """What a decode replica on vLLM starts a handed-over request from: the prefill request's
    `kv_transfer_params` (the connector's folder, `saved_tokens`, `bytes`), which its backend
    passes to vLLM with `do_remote_prefill` so that vLLM loads the K/V instead of computing it."""

    params: dict[str, Any]

    @property
    def tokens(self) -> int:
        return int(self.params.get("saved_tokens") or 0)


async def prefill_and_export(backend: Any, puller: KvPuller | None, request: GenerateRequest, first: int) -> HandoverResult:
    """On the prefill replica: run `request` (a prefill_request) to its one token, then export the
    blocks from `first` on (the decode replica holds the ones before). A backend with its own
    connector (vLLM: `prefill_for_handover`) saves the prompt's K/V itself while it runs it."""
    connector = getattr(backend, "prefill_for_handover", None)
    if connector is not None:
        params = await connector(request)
        bs = backend.facts.block_size
        return HandoverResult(None, (len(request.prompt_token_ids) - 1) // bs, kv_transfer_params=params)
    async with contextlib.aclosing(backend.generate(request)) as outputs:
        async for out in outputs:
            if out.finished:
                break
    facts = backend.facts
    bs = facts.block_size
    n = (len(request.prompt_token_ids) - 1) // bs
    if puller is None or n <= first:
        return HandoverResult(None, n)
    adapter = request.adapter.identity if request.adapter is not None else None
    hashes = block_hashes(request.prompt_token_ids[: n * bs], bs, chain_seed(facts.model_id, request.cache_salt, adapter))
    kv = await puller.export(hashes, request.prompt_token_ids[: n * bs], first)
    return HandoverResult(kv, n)


class HandoverMetrics:
    """prefixgate_pd_* through Ray's metrics (replica/serve/metrics.py's conventions)."""

    def __init__(self, model_name: str) -> None:
        tags = {"model_name": model_name}
        self.handovers = Metric("counter", "prefixgate_pd_handovers", "Prefill hand-overs asked of a prefill replica by this "
                                "decode replica, by outcome (all but ok: the prompt computed here)", ["outcome"],
                                default_tags=tags)
        self.latency = Metric("histogram", "prefixgate_pd_handover_seconds", "A hand-over's time: the prefill replica's "
                              "queue, prefill and copy", buckets=LATENCY_BUCKETS, default_tags=tags)
        self.tokens = Metric("counter", "prefixgate_pd_handover_tokens", "Prompt tokens whose K/V a prefill replica "
                             "handed over", default_tags=tags)
        self.bytes = Metric("counter", "prefixgate_pd_handover_bytes", "K/V bytes handed over", default_tags=tags)
        for outcome in OUTCOMES:
            self.handovers.zero(outcome)
        self.tokens.zero()
        self.bytes.zero()


@dataclass
class HandoverStats:
    """Counts in info()["stats"]["handover"]."""

    asked: int = 0
    ok: int = 0
    empty: int = 0  # the prefill replica computed it, but no block was left to copy
    timeouts: int = 0
    failed: int = 0  # the prefill replica dead, gone or failing: computed here
    tokens: int = 0
    bytes: int = 0
    last_error: str = ""
    latencies: list[float] = field(default_factory=list)  # the last 100, seconds


class Handover:
    """A decode replica's side: asks the decision's prefill replica, by id, for the prompt's K/V."""

    def __init__(self, caller: ReplicaCaller, block_size: int, held: Any, moves_bytes: bool,
                 timeout_s: float = HANDOVER_TIMEOUT_S, metrics: HandoverMetrics | None = None,
                 connector: Any = None) -> None:
        self.caller = caller  # the prefill deployment's replicas
        self.block_size = block_size
        self.held = held  # the engine's hash -> block map: the leading blocks it holds are not asked for
        self.moves_bytes = moves_bytes  # our engine imports K/V bytes; the sim engine models the transfer
        # vLLM: its KV connector moves the K/V (replica/backends/vllm_backend.py HandoverFiles: the
        # hand-over's files, deleted once loaded, and swept when a hand-over was given up on)
        self.connector = connector
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.stats = HandoverStats()
        self.in_flight = 0  # requests waiting on a prefill replica now (the heartbeat counts them as waiting)

    async def run(self, source: KvSource, request: GenerateRequest, model_id: str) -> Any:
        """The K/V to start `request` from (our engine: KvBlocks), or None: the prompt is computed
        here. On the sim engine the request gets the modelled transfer as its pull hint instead."""
        bs = self.block_size
        n = min(source.num_blocks, (len(request.prompt_token_ids) - 1) // bs)
        adapter = request.adapter.identity if request.adapter is not None else None
        first = 0
        if n > 0 and self.moves_bytes:
            hashes = block_hashes(request.prompt_token_ids[: n * bs], bs, chain_seed(model_id, request.cache_salt, adapter))
            while first < n and hashes[first] in self.held:
                first += 1
        self.stats.asked += 1
        if self.connector is not None:
            # the files of hand-overs given up on (timeout, failure): long past any load of theirs
            self.connector.sweep(max(2 * self.timeout_s, SWEEP_AFTER_S))
        start = time.perf_counter()
        self.in_flight += 1
        try:
            result = await asyncio.wait_for(
                self.caller.call(source.replica_id, "prefill_kv", prefill_request(request), first), self.timeout_s)
        except TimeoutError:
            self.stats.last_error = f"timeout after {self.timeout_s} s"
            return self._outcome("timeout")
        except Exception as err:  # dead, gone from Serve, its engine failed: compute here
            self.stats.last_error = f"{type(err).__name__}: {err}"[:300]
            log.info("hand-over from %s failed: %s", source.replica_id, self.stats.last_error)
            return self._outcome("failed")
        finally:
            self.in_flight -= 1
        seconds = time.perf_counter() - start
        if self.connector is not None:
            params = result.kv_transfer_params
            kv = ConnectorKv(params) if params else None
            if kv is None or kv.tokens == 0:
                return self._outcome("empty")
            tokens, nbytes = kv.tokens, int(params.get("bytes") or 0)
        elif self.moves_bytes:
            kv = result.kv
            if kv is None or kv.num_blocks == 0:
                return self._outcome("empty")
            tokens, nbytes = kv.num_blocks * bs, kv.nbytes
        else:
            kv = None
            request.pull = KvSource(source.replica_id, result.num_blocks)  # the sim engine models the copy
            tokens, nbytes = result.num_blocks * bs, 0
        self.stats.tokens += tokens
        self.stats.bytes += nbytes
        self.stats.latencies = [*self.stats.latencies[-99:], seconds]
        if self.metrics is not None:
            self.metrics.latency.observe(seconds)
            self.metrics.tokens.inc(tokens)
            self.metrics.bytes.inc(nbytes)
        self._outcome("ok")
        return kv

    def _outcome(self, outcome: str) -> None:
        counter = "timeouts" if outcome == "timeout" else outcome
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        if self.metrics is not None:
            self.metrics.handovers.labels(outcome).inc()
        return None


def for_replica(backend: Any, puller: KvPuller | None, prefill_deployment: str, timeout_s: float) -> Handover | None:
    """A decode replica's hand-over side, asking the replicas of its app's `prefill_deployment`;
    None outside Serve (no app to find them in)."""
    try:
        from ray import serve
        from ray.serve._private.common import DeploymentID

        app = serve.get_replica_context().replica_id.deployment_id.app_name
    except Exception:  # no replica context
        return None
    from replica.kv_io.kv_pull import ReplicaCaller

    caller = ReplicaCaller(DeploymentID(name=prefill_deployment, app_name=app))
    facts = backend.facts
    held = backend.engine.engine.blocks.hash_to_block if puller is not None else {}
    return Handover(caller, facts.block_size, held, moves_bytes=puller is not None, timeout_s=timeout_s,
                    metrics=HandoverMetrics(facts.model_id), connector=getattr(backend, "handover_files", None))
