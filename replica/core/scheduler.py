"""Continuous batching: which tokens of which sequences run in the next forward pass.

Every step mixes decodes (one token each for running sequences) with prefill chunks of new
or partially prefilled sequences, under a token budget, so long prompts never stall decoding.
Blocks are reserved per chunk (a long prompt holds only the blocks computed so far). When the
pool runs dry, the running sequence last in (priority, arrival) order is preempted: its blocks are released
(hashed ones stay cached) and it is recomputed later, usually from cache. A step that preempted
admits nobody, as in vLLM, so a sequence is never preempted and re-admitted in the same step.
A request for a LoRA adapter is admitted only when its adapter can hold one of the batch's
`max_loras` slots; until then it waits, and requests behind it go first only if they need no
slot (the base model's). vLLM lets every request behind it go, so an adapter whose slot holders
keep getting new requests starves the others; here the holders drain and it gets a slot within
one request's time.

Priority (vLLM's `scheduling_policy="priority"`: lower values first, arrival order within one):
waiting sequences are admitted, and running ones served each step, in (priority, arrival)
order; the pool's victim is the running sequence last in that order; and a running prefill
behind the waiting head's priority yields its step to that head, and that step admits only
sequences that outrank the prefills that yielded, so a short urgent prompt neither waits for the
prefills admitted before it nor shares its step with the ones queued behind it (its step is its
prefill and the decodes: the shortest step that serves it). `long_prefill_token_threshold` (vLLM's) caps one
prefill chunk while sequences wait, so a long prompt leaves part of every step's budget to
those behind it: a short prompt that arrives during a long prefill starts within one step.

Latency objectives (replica/core/step_sizing.py): while rows with TPOT objectives decode, each
step's prefill tokens are capped so the step keeps them within their objectives, and a request
whose TTFT deadline is near goes first among its priority (running prefills of its priority
yield their step to it, as to a higher priority's head). Without objectives, nothing changes.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from replica.core.adapter_slots import AdapterSlots
from replica.core.sequence import Sequence, Status
from replica.core.step_sizing import StepSizer
from replica.engine_config import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS
from replica.kvcache.block_manager import BlockManager


@dataclass
class SchedulerConfig:
    max_num_seqs: int = MAX_NUM_SEQS
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS  # prefill chunk budget per step, decodes included
    long_prefill_token_threshold: int = 0  # most prompt tokens of one sequence per step (0: the whole budget)


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed this step
    end: int  # one past the last

    @property
    def samples(self) -> bool:
        """The step reaches the sequence's last token, so its logits give the next token."""
        return self.end == self.seq.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, adapters: AdapterSlots | None = None,
                 sizer: StepSizer | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock  # the engine's clock (EngineCore): objectives are judged on it
        self.blocks = blocks
        self.adapters = adapters
        self.sizer = sizer if sizer is not None else StepSizer(config.max_num_batched_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._arrivals = itertools.count()

    def add(self, seq: Sequence) -> None:
        seq.arrival_seq = next(self._arrivals)
        self._queue(seq)
        self.sizer.track(seq)

    def _queue(self, seq: Sequence) -> None:
        """Into `waiting` at its place in (priority, arrival) order (usually the end: O(1))."""
        key = _order(seq)
        pos = len(self.waiting)
        while pos and _order(self.waiting[pos - 1]) > key:
            pos -= 1
        self.waiting.insert(pos, seq)

    def _chunk(self, seq: Sequence, budget: int, prefill_left: int) -> int:
        """Tokens of `seq` to compute this step: the rest of its prompt or one decode, within the
        budget; a prompt's chunk capped by the long-prefill threshold while others wait (alone,
        a long prompt takes the whole budget: the cap only makes room, never idles it) and by
        the prefill tokens the step's objectives leave (`prefill_left`; 0: none)."""
        n = min(seq.num_tokens - seq.num_computed, budget)
        if n == 1 and seq.num_computed >= seq.num_prompt_tokens:
            return n  # a decode
        cap = self.config.long_prefill_token_threshold
        n = min(n, cap) if cap > 0 and n > 1 and self.waiting else n
        return min(n, prefill_left)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        """The next step's chunks, following vLLM's rules: running sequences first (in
        (priority, arrival) order), blocks reserved only for the tokens computed this step, and
        no admission in a step that preempted (the preempted sequence waits at the head of the
        queue)."""
        chunks: list[ScheduledChunk] = []
        budget = self.config.max_num_batched_tokens
        preempted = False
        now = self.clock()
        cap = self.sizer.prefill_cap(self.running, now)
        prefill_left = budget if cap is None else cap  # prefill tokens the objectives leave this step
        urgent = self.sizer.urgent(now)
        if urgent is not None:
            self._first_of_its_priority(urgent)
        # 1. running sequences in (priority, arrival) order: decodes and unfinished prefills; a
        #    prefill behind the waiting head's priority (or of an urgent head's) yields its chunk
        #    to that head (step 2)
        head = self._admissible_head(budget)
        yielded: tuple[int, int] | None = None  # (priority, arrival) of the first prefill that yielded to the head
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if head is not None and seq.num_tokens - seq.num_computed > 1 and (
                    _order(head) < _order(seq) or (head is urgent and head.priority <= seq.priority)):
                yielded = yielded or _order(seq)  # running is in that order: the first is the least
                i += 1
                continue
            n = self._chunk(seq, budget, prefill_left)
            if n == 0:  # a prefill the objectives leave no room for this step
                i += 1
                continue
            fits, evicted = self._ensure_room(seq, seq.num_computed + n, i)
            preempted = preempted or evicted
            if not fits:
                continue  # seq itself was preempted; running shrank
            chunks.append(ScheduledChunk(seq, seq.num_computed, seq.num_computed + n))
            budget -= n
            if n > 1 or seq.num_computed < seq.num_prompt_tokens:
                prefill_left -= n
            i += 1
        if preempted:
            return chunks
        # 2. admit waiting sequences while the budget, the batch size and the pool allow
        passed: list[Sequence] = []  # waiting for an adapter slot: stay at the head, in order
        while self.waiting and budget > 0 and prefill_left > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if yielded is not None and seq is not urgent and _order(seq) >= yielded:
                break  # the step a prefill yielded is the urgent head's: nothing it outranks fills it
            if seq.adapter is not None and (passed or not self.adapters.can_admit(seq.adapter)):
                passed.append(self.waiting.popleft())  # behind a request waiting for a slot, no
                continue  # adapter request goes first: the slot holders drain, so it cannot starve
            plan = self.blocks.plan(seq.table, seq.num_tokens, budget)
            if plan is None:
                break
            self.waiting.popleft()
            if seq.adapter is not None:
                seq.lora_slot = self.adapters.acquire(seq.adapter)
            cached = self.blocks.allocate(seq.table, plan=plan)
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = cached
            seq.num_computed = cached
            seq.status = Status.RUNNING
            self._run(seq)
            n = self._chunk(seq, budget, prefill_left)
            chunks.append(ScheduledChunk(seq, cached, cached + n))
            budget -= n
            prefill_left -= n
        self.waiting.extendleft(reversed(passed))
        return chunks

    def _first_of_its_priority(self, seq: Sequence) -> None:
        """Move waiting `seq` ahead of the others of its priority (an urgent deadline)."""
        waiting = self.waiting
        if waiting[0] is seq:
            return
        waiting.remove(seq)
        pos = 0
        while pos < len(waiting) and waiting[pos].priority < seq.priority:
            pos += 1
        waiting.insert(pos, seq)

    def _admissible_head(self, budget: int) -> Sequence | None:
        """The waiting sequence step 2 would admit first, if it can be admitted now."""
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return None
        seq = self.waiting[0]
        if seq.adapter is not None and not self.adapters.can_admit(seq.adapter):
            return None
        return seq if self.blocks.can_allocate(seq.table, seq.num_tokens, budget) else None

    def _run(self, seq: Sequence) -> None:
        """Into `running` at its place in (priority, arrival) order: the next steps serve it there."""
        key = _order(seq)
        pos = len(self.running)
        while pos and _order(self.running[pos - 1]) > key:
            pos -= 1
        self.running.insert(pos, seq)

    def _ensure_room(self, seq: Sequence, num_tokens: int, first: int) -> tuple[bool, bool]:
        """Give `seq` (running[first]) blocks for its first `num_tokens` tokens, preempting
        sequences not scheduled yet this step (running[first:]), the newest of the lowest
        priority first. Returns (seq still runs, something was preempted)."""
        preempted = False
        while not self.blocks.can_append(seq.table, num_tokens):
            victim = max(self.running[first:], key=_order)
            self._preempt(victim)
            preempted = True
            if victim is seq:
                return False, True
        self.blocks.append(seq.table, num_tokens)
        return True, preempted

    def _leave_slot(self, seq: Sequence) -> None:
        if seq.adapter is not None and seq.lora_slot >= 0:
            self.adapters.release(seq.adapter)
            seq.lora_slot = -1

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._leave_slot(seq)
        self.blocks.free(seq.table)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._queue(seq)  # by its first arrival: ahead of everything of its priority that came later

    def commit(self, chunks: list[ScheduledChunk]) -> None:
        """Record the computed tokens so full blocks become cache entries."""
        for c in chunks:
            c.seq.num_computed = c.end
            self.blocks.commit(c.seq.table, c.seq.token_ids, c.end, c.seq.hash_seed)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        self.sizer.untrack(seq)
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
            self._leave_slot(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.table)


def _order(seq: Sequence) -> tuple[int, int]:
    return seq.priority, seq.arrival_seq
