"""A simulated replica with a role (prefill, decode or both) whose decode steps feel its prefills.

The colocated replica (router/sim/replica.py) prices a decode as `output_tokens * step(B)`,
so a prefill beside a decode batch slows the prefill but never the decode. A live engine step
runs the decode batch *and* a prefill chunk (`ServiceModel.engine_step_s`), so while a prefill
is in the slot every decoding sequence gets one token per chunk step, and that step is longer
by the chunk's tokens: the interference that prefill/decode disaggregation removes. Here:

- a prefill of `u` uncached tokens with `B` sequences decoding takes the sum of
  `engine_step_s(B, chunk_i, first)` over its `ceil(u / chunk_tokens)` chunks (the service
  model's prefill time, with whole steps), plus any tier copy or adapter read before it;
- decoding is fluid between events: every sequence advances at one token per step, the step
  being `step_s(B)` with the slot idle, and the prefill's steps over its duration while the slot
  is busy (a copy before the prefill counts as plain decode steps). One virtual clock of tokens
  per sequence serves the whole batch; a sequence finishes when the clock passes its target.

Roles: `both` is the colocated replica with this step model; `prefill` computes prompts only
(no decode batch, so its prefills run back to back at the prefill rate, which in this linear
model is what batching them per step gives) and holds the prompt's blocks until the K/V has
been handed over; `decode` runs what is below the threshold as `both` does and takes hand-overs
straight into its decode batch, without the prefill slot.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass

from replica.kvcache.block_manager import BlockTable
from router.sim.replica import Job, SimReplica
from router.sim.workload import SimRequest

BOTH, PREFILL, DECODE = "both", "prefill", "decode"
ROLES = (BOTH, PREFILL, DECODE)
_FIRST, _DONE = 0, 1
_EPS = 1e-6  # tokens: float slack when the virtual clock reaches a target


@dataclass(slots=True)
class PdJob(Job):
    decode_rep: PdReplica | None = None  # set when the request is handed over to this replica
    handed: bool = False
    prefill_end: float = math.nan  # on the prefill replica
    transfer_tokens: int = 0  # K/V moved to the decode replica
    transfer_s: float = 0.0
    first_token: float = math.nan  # absolute (scaled) time
    done: float = math.nan


class PdReplica(SimReplica):
    def __init__(self, *args, role: str = BOTH, **kwargs) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        super().__init__(*args, **kwargs)
        self.role = role
        self.handovers: deque[PdJob] = deque()  # handed over, waiting for batch room or blocks
        self.v = 0.0  # tokens each decoding sequence has produced so far (virtual clock)
        self.v_at = 0.0
        self.rate = 0.0  # of the virtual clock, tokens/s
        self.slot_rate = 0.0  # while the prefill slot is busy: its steps over its duration
        self._steps = 0.0  # steps of the prefill being started (prefill_time -> try_start)
        self.targets: list[tuple[float, int, int, PdJob]] = []
        self._seq = itertools.count()
        self.version = 0  # bumped on every rate change: older decode events are stale
        self.next_t = math.inf

    # ---- the step model -----------------------------------------------------------------------
    def alloc_tokens(self, req: SimRequest) -> int:
        """A prefill replica holds the prompt only; the output's room is the decode replica's."""
        if self.role == PREFILL:
            return len(req.hashes) * self.block_size
        return super().alloc_tokens(req)

    def prefill_time(self, uncached: int) -> float:
        """Whole chunk steps of `engine_step_s`, the decode batch riding in each."""
        s = self.service
        chunks = max(math.ceil(uncached / s.chunk_tokens), 1)
        left, t = uncached, 0.0
        for i in range(chunks):
            n = min(left, s.chunk_tokens)
            t += s.engine_step_s(self.decoding, n, prefills_started=int(i == 0))
            left -= n
        self._steps = chunks
        return t

    def _advance(self, now: float) -> None:
        self.v += self.rate * (now - self.v_at)
        self.v_at = now

    def _retime(self, now: float) -> None:
        """After a change of batch or slot: the new rate and when the next target is reached."""
        if not self.decoding:
            self.rate = 0.0
        elif self.current is not None:
            self.rate = self.slot_rate
        else:
            self.rate = 1.0 / self.service.step_s(self.decoding)
        self.version += 1
        if self.targets and self.rate > 0:
            self.next_t = now + max(self.targets[0][0] - self.v, 0.0) / self.rate
        else:
            self.next_t = math.inf

    def _join(self, job: PdJob, now: float, first_done: bool) -> None:
        """Into the decode batch: the rest of its output (and its first token, if still due)."""
        out = job.req.output_tokens
        if first_done and out <= 1:
            self._finish(job, now)
            return
        self.decoding += 1
        if not first_done:
            heapq.heappush(self.targets, (self.v + 1, next(self._seq), _FIRST, job))
        heapq.heappush(self.targets, (self.v + max(out - (1 if first_done else 0), 1), next(self._seq), _DONE, job))

    def _finish(self, job: PdJob, now: float) -> None:
        job.done = now
        assert job.table is not None
        self.bm.free(job.table)

    # ---- what the engine calls ----------------------------------------------------------------
    def try_start(self, now: float) -> float | None:
        self._advance(now)
        end = super().try_start(now)
        if end is not None:
            dur = end - now
            compute = self.prefill_time_last
            # a copy or adapter read before the prefill: the batch decodes at its own pace
            steps = self._steps + max(dur - compute, 0.0) / self.service.step_s(max(self.decoding, 1))
            self.slot_rate = steps / dur if dur > 0 else 0.0
        self._retime(now)
        return end

    @property
    def prefill_time_last(self) -> float:
        """The compute part of the prefill just started (its duration less copies and reads)."""
        job = self.current
        assert job is not None
        return self.cur_end - self.cur_start - job.tier_s - job.adapter_load_s

    def prefill_done(self, now: float) -> tuple[Job, float]:  # type: ignore[override]
        """The prompt is computed: its blocks enter the cache. A prefill replica keeps them
        pinned for the hand-over (`release`); otherwise the request decodes here, its first
        token out with the prefill's last step."""
        self._advance(now)
        job = self.current
        assert isinstance(job, PdJob) and job.table is not None
        self.current = None
        self.bm.commit(job.table, [], len(job.req.hashes) * self.block_size, seed=0)
        if self.role == PREFILL:
            job.prefill_end = now
        else:
            job.first_token = now
            job.ttft = now - job.arrival
            self._join(job, now, first_done=True)
        self._retime(now)
        return job, now

    def release(self, job: PdJob) -> None:
        """The decode replica has the K/V: unpin the prompt's blocks here (they stay cached)."""
        assert job.table is not None
        self.bm.free(job.table)
        job.table = None

    def held_run(self, hashes: list[int]) -> int:
        """Leading blocks of `hashes` in this replica's pool now."""
        held = self.bm.hash_to_block
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def admit_handovers(self, now: float) -> list[PdJob]:
        """Handed-over requests into the decode batch, in order, while batch room and blocks
        allow; their blocks (hits and transferred) enter this replica's cache."""
        admitted: list[PdJob] = []
        if not self.handovers:
            return admitted
        self._advance(now)
        while self.handovers and self.decoding < self.service.max_running:
            job = self.handovers[0]
            req = job.req
            table = BlockTable(hashes=req.hashes)
            need = self.alloc_tokens(req)
            if not self.bm.can_allocate(table, need):
                break
            self.handovers.popleft()
            self.bm.allocate(table, need)
            self.bm.commit(table, [], len(req.hashes) * self.block_size, seed=0)
            job.table = table
            self._join(job, now, first_done=False)
            admitted.append(job)
        self._retime(now)
        return admitted

    def decode_event(self, now: float, version: int) -> list[PdJob]:
        """The virtual clock reached the next target (unless the event is stale): first tokens
        and finishes; returns the finished requests."""
        if version != self.version:
            return []
        self._advance(now)
        finished: list[PdJob] = []
        while self.targets and self.targets[0][0] <= self.v + _EPS:
            _, _, kind, job = heapq.heappop(self.targets)
            if kind == _FIRST:
                job.first_token = now
                job.ttft = now - job.arrival
            else:
                self.decoding -= 1
                self._finish(job, now)
                finished.append(job)
        self._retime(now)
        return finished

    def queue_len(self) -> int:
        return super().queue_len() + len(self.handovers)
