"""One simulated replica: the real BlockManager (no tensors), a FIFO queue and a prefill slot.

Blocks come and go exactly as on a real replica: a request gets its prompt blocks (cache hits
taken from the LRU) plus room for its output when it is admitted, the prompt blocks become
cache entries when its prefill completes, and everything is released when it finishes. Cache
membership changes reach the router's index through the same listener hook the real replica
uses to publish KV events. What the pool evicts moves to the replica's own host and disk tiers
when it has them (router/sim/tiers.py); a hit there is copied back before the prefill, at the
tier's modelled rate. A request under a LoRA adapter the replica does not hold in host memory
reads it from disk first, in its prefill slot (router/sim/lora.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from replica.kvcache.block_manager import BlockManager, BlockTable
from router.costs.adapter_memory import AdapterLru, LoraConfig
from router.costs.service import ServiceModel
from router.costs.tier_costs import copy_s
from router.costs.transfer_model import TransferModel
from router.index.memory_index import InMemoryIndex
from router.policy import ReplicaView
from router.protocol.media import DEVICE
from router.protocol.redis_schema import LOAD_FIELDS, Heartbeat
from router.sim.tiers import TierConfig, tier_heartbeat
from router.sim.workload import SimRequest

HOLDER_MODES = ("keep", "touch", "demote")


class IndexFeed:
    """KVEventListener that forwards one replica's cache events, with their medium, to the index."""

    def __init__(self, replica_id: str, index: InMemoryIndex) -> None:
        self.replica_id = replica_id
        self.index = index

    def stored(self, hashes: list[int], positions: list[int], medium: str = DEVICE) -> None:
        self.index.stored(self.replica_id, hashes, medium)

    def removed(self, hashes: list[int], medium: str = DEVICE) -> None:
        self.index.removed(self.replica_id, hashes, medium)

    def cleared(self) -> None:
        self.index.clear(self.replica_id)


@dataclass(slots=True)
class Job:
    req: SimRequest
    arrival: float  # scaled time
    est_uncached: int  # what the router expected to compute here, counted as queued work
    window: int  # imbalance window of the arrival
    table: BlockTable | None = None
    hit_blocks: int = 0  # in any tier of this replica
    promoted: dict[str, int] | None = None  # of hit_blocks, copied back from each lower tier
    tier_s: float = 0.0  # modelled time of those copies
    uncached: int = 0
    ttft: float = 0.0
    pull_from: SimReplica | None = None  # the router's pull hint: the holder ...
    pull_depth: int = 0  # ... and the leading blocks read from it at arrival (`export_run`)
    pulled_blocks: int = 0  # blocks copied: those of pull_depth this replica did not hit itself
    pull_s: float = 0.0
    adapter_read: bool = False  # its LoRA adapter was read from disk before its prefill ...
    adapter_load_s: float = 0.0  # ... taking this long


class SimReplica:
    def __init__(
        self, replica_id: str, capacity_blocks: int, block_size: int, service: ServiceModel, index: InMemoryIndex,
        transfer: TransferModel | None = None, pull_holder: str = "keep", tiers: TierConfig | None = None,
        lora: LoraConfig | None = None,
    ) -> None:
        if pull_holder not in HOLDER_MODES:
            raise ValueError(f"pull_holder must be one of {HOLDER_MODES}, got {pull_holder!r}")
        self.replica_id = replica_id
        self.block_size = block_size
        self.service = service
        self.transfer = transfer or TransferModel()
        self.pull_holder = pull_holder  # what a pull does to the holder's LRU (HOLDER_MODES)
        tiers = tiers or TierConfig()
        self.bm = BlockManager(capacity_blocks, block_size, tiers.host_blocks, tiers.disk_blocks)
        for tier in self.bm.tiers:  # a tier slower than recomputing is never read back
            tier.promote = self.transfer.tier_pays(tier.medium)
        self.bm.listeners.append(IndexFeed(replica_id, index))
        self.adapters = AdapterLru(lora or LoraConfig())  # LoRA adapters in host memory
        self.queue: deque[Job] = deque()
        self.queued_tokens = 0
        self.current: Job | None = None  # the prefill in progress
        self.cur_start = 0.0
        self.cur_end = 0.0
        self.decoding = 0
        self.busy_s = 0.0  # prefill time, for utilization

    def alloc_tokens(self, req: SimRequest) -> int:
        """Every block key is treated as a full block, plus room for the whole output up front
        (no preemption in the model). Keeps all prompt blocks eligible for a hit."""
        return len(req.hashes) * self.block_size + max(req.output_tokens, 1)

    def fits(self, req: SimRequest) -> bool:
        return self.bm.blocks_needed(self.alloc_tokens(req)) <= self.bm.num_blocks

    def pending_tokens(self, now: float) -> int:
        pending = self.queued_tokens
        job = self.current
        if job is not None and self.cur_end > now:
            pending += int(job.uncached * (self.cur_end - now) / (self.cur_end - self.cur_start))
        return pending

    def view(self, now: float, matched: int) -> ReplicaView:
        bm = self.bm
        return ReplicaView(
            replica_id=self.replica_id,
            matched_blocks=matched,
            running=self.decoding + (self.current is not None),
            waiting=len(self.queue),
            pending_prefill_tokens=self.pending_tokens(now),
            free_blocks=bm.num_free,
            cached_blocks=bm.num_cached,
            capacity_blocks=bm.num_blocks,
        )

    def heartbeat(self, now: float) -> dict[str, int]:
        """Its load as a live replica's heartbeat reports it (the LOAD_FIELDS a router reads);
        kv_pull 1: simulated replicas import and export K/V. Pull rates stay 0 (unmeasured): the
        pull policy is given the simulator's transfer model directly. Tiers: their occupancy and
        modelled rates, with the K/V bytes per token they move, as a live replica reports them.
        LoRA: the resident adapters and the read time, as a live replica reports them."""
        v = self.view(now, 0)
        tiers = tier_heartbeat(self.bm, self.transfer)
        hb = Heartbeat(running=v.running, waiting=v.waiting, pending_prefill_tokens=v.pending_prefill_tokens,
                       free_blocks=v.free_blocks, cached_blocks=v.cached_blocks,
                       capacity_blocks=v.capacity_blocks, kv_pull=1,
                       kv_bytes_per_token=int(self.transfer.kv_bytes_per_token), **tiers,
                       **self.adapters.heartbeat())
        return {f: getattr(hb, f) for f in LOAD_FIELDS}

    def copy_tokens(self, tier_blocks: dict[str, int]) -> float:
        """Copying these lower-tier blocks back, in prompt tokens of prefill (queued work)."""
        return copy_s(self.transfer, tier_blocks, self.block_size) * self.transfer.prefill_tokens_per_s

    def adapter_tokens(self, identity: str | None) -> float:
        """Reading this adapter from disk here (0 when resident), in prompt tokens of prefill."""
        if self.adapters.holds(identity):
            return 0.0
        return self.adapters.config.load_ms / 1000 * self.transfer.prefill_tokens_per_s

    def queue_len(self) -> int:
        """Requests sent here and not finished: what the live router's own count would say."""
        return self.decoding + (self.current is not None) + len(self.queue)

    def enqueue(self, job: Job) -> None:
        self.queue.append(job)
        self.queued_tokens += job.est_uncached

    def try_start(self, now: float) -> float | None:
        """Admit the head of the queue if the prefill slot, batch and pool allow; returns
        when its prefill ends, or None."""
        if self.current is not None or not self.queue or self.decoding >= self.service.max_running:
            return None
        job = self.queue[0]
        req = job.req
        table = BlockTable(hashes=req.hashes)  # shared, never grown: commit finds it complete
        need = self.alloc_tokens(req)
        if not self.bm.can_allocate(table, need):
            return None  # head-of-line: wait for a finish to free blocks
        self.queue.popleft()
        self.queued_tokens -= job.est_uncached
        cached = self.bm.allocate(table, need)
        job.table = table
        job.hit_blocks = cached // self.block_size
        job.promoted = dict(table.promoted)
        job.tier_s = copy_s(self.transfer, job.promoted, self.block_size)
        pulled_tokens = self._pull(job)
        job.uncached = max(req.input_tokens - cached - pulled_tokens, 1)
        job.pull_s = self.transfer.pull_s(pulled_tokens)
        # the transfer started when the request arrived (a replica pulls before it queues the
        # request for its engine): only what is left of it when the request is admitted
        # delays the prefill
        pull_left = max(job.arrival + job.pull_s - now, 0.0)
        job.adapter_read = self.adapters.use(req.adapter)  # resident from now on
        job.adapter_load_s = self.adapters.config.load_ms / 1000 if job.adapter_read else 0.0
        dur = job.tier_s + pull_left + job.adapter_load_s + self.prefill_time(job.uncached)
        self.current, self.cur_start, self.cur_end = job, now, now + dur
        self.busy_s += dur
        return self.cur_end

    def prefill_time(self, uncached: int) -> float:
        """The compute part of a prefill of `uncached` tokens starting now (the service model's,
        the decode batch sampled at the start); router/sim/pd_replica.py steps it instead."""
        return self.service.prefill_s(uncached, self.decoding)

    def export_run(self, hashes: list[int], limit: int, local: int = 0, mode: str = "keep") -> int:
        """A pull from this replica, as the request reaches the puller: the leading run of
        `hashes` (at most `limit` blocks) in this replica's pool, read now. A live replica pulls
        when the request arrives, before it queues for the engine (replica/kv_io/kv_pull.py), so
        what the holder evicts later does not shorten the pull. `mode`: what the read does to
        the exported blocks past the puller's own `local` ones in this LRU (`after_export`)."""
        held = self.bm.hash_to_block
        n = 0
        for h in hashes[:limit]:
            if h not in held:
                break
            n += 1
        if n > local and mode != "keep":
            self.after_export(hashes[local:n], mode)
        return n

    def _pull(self, job: Job) -> int:
        """The blocks read from the hinted holder at arrival (`export_run`) past this replica's
        own hits; returns prompt tokens covered. The copies occupy blocks allocated here and are
        registered with the rest of the prompt when prefill completes, exactly as computed ones."""
        src = job.pull_from
        if src is None or src is self or job.pull_depth <= job.hit_blocks:
            return 0
        n = job.pull_depth - job.hit_blocks
        job.pulled_blocks = n
        return min(n * self.block_size, max(job.req.input_tokens - 1 - job.hit_blocks * self.block_size, 0))

    def after_export(self, hashes: list[int], mode: str) -> None:
        """What reading blocks for another replica does to this holder's LRU: "touch" releases
        them as most recently used (a pin and unpin, what the real engine's export does today),
        "demote" as least recently used (another copy now exists: this one goes first)."""
        if mode == "touch":
            self.bm.unpin(self.bm.pin_prefix(hashes))
        elif mode == "demote":
            self.bm.demote(hashes)

    def prefill_done(self, now: float) -> tuple[Job, float]:
        """Publish the prompt's blocks and move the job to decode; returns (job, finish time)."""
        job = self.current
        assert job is not None and job.table is not None
        self.current = None
        self.bm.commit(job.table, [], len(job.req.hashes) * self.block_size, seed=0)
        job.ttft = now - job.arrival
        self.decoding += 1
        return job, now + self.service.decode_s(job.req.output_tokens, self.decoding)

    def finish(self, job: Job) -> None:
        assert job.table is not None
        self.bm.free(job.table)
        self.decoding -= 1
