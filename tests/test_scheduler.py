"""Scheduler rules shared with vLLM: blocks reserved per chunk, no admission in a step that
preempted. Pure logic on the tensor-free BlockManager."""

from __future__ import annotations

from replica.core.scheduler import Scheduler, SchedulerConfig
from replica.core.sequence import Sequence, Status
from replica.kvcache.block_manager import BlockManager
from router.protocol.hashing import block_hashes
from router.protocol.sampling import SamplingParams

BS = 4


def _seq(tokens: list[int], max_tokens: int = 8) -> Sequence:
    seq = Sequence(tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), hash_seed=0)
    seq.table.hashes = block_hashes(tokens, BS, 0)
    return seq


def _step(sched: Scheduler, next_token: int = 7):
    """One step as the engine runs it: schedule, commit, append a token where one is sampled."""
    chunks = sched.schedule()
    sched.commit(chunks)
    for c in chunks:
        if c.samples:
            c.seq.token_ids.append(next_token)
    return chunks


def test_blocks_are_reserved_per_chunk():
    bm = BlockManager(64, BS)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8), bm)
    seq = _seq(list(range(10, 50)))  # 40 tokens: 5 chunks of 8
    sched.add(seq)
    held = []
    for _ in range(5):
        [chunk] = _step(sched)
        held.append(len(seq.table.block_ids))
        assert len(seq.table.block_ids) == -(-chunk.end // BS)  # only what was computed so far
    assert held == [2, 4, 6, 8, 10]
    assert seq.num_computed == 40 and seq.num_tokens == 41  # the last chunk sampled a token


def test_admission_reserves_hits_plus_first_chunk_only():
    bm = BlockManager(64, BS)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=6), bm)
    first = _seq(list(range(100, 120)))
    sched.add(first)
    while first.num_computed < 20:
        _step(sched)
    second = _seq(list(range(100, 116)) + list(range(200, 230)))  # 4 blocks hit, 30 new tokens
    sched.add(second)
    chunks = _step(sched)
    mine = [c for c in chunks if c.seq is second]
    assert mine and mine[0].start == 16 and second.num_cached_tokens == 16
    assert len(second.table.block_ids) == -(-mine[0].end // BS) < bm.blocks_needed(second.num_tokens)


def test_no_admission_in_a_step_that_preempted():
    # Two identical prompts computed in the same step: only the first one's blocks become cache
    # entries, so preempting the second frees unhashed blocks while the first keeps its hits
    # alive. Right after that preemption the victim would fit again; vLLM (and we) wait a step.
    bm = BlockManager(7, BS)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm)
    a, b, c = _seq([1, 2, 3, 4]), _seq(list(range(10, 20))), _seq(list(range(10, 20)))
    for s in (a, b, c):
        sched.add(s)
    _step(sched)  # 1 + 3 + 3 blocks: the pool is full; a now needs a second block
    assert bm.num_available == 0
    chunks = _step(sched)
    assert sched.num_preemptions == 1 and c.status is Status.WAITING and sched.waiting[0] is c
    assert [ch.seq for ch in chunks] == [a, b]  # the victim is not re-admitted in this step...
    assert bm.can_allocate(c.table, c.num_tokens, 64)  # ...although it would fit
    chunks = _step(sched)
    assert c.status is Status.RUNNING and chunks[-1].seq is c and chunks[-1].start == 8  # 2 blocks hit


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    bm = BlockManager(64, BS)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64), bm)
    order = []
    for name, priority in (("flex-1", 1), ("default-1", 0), ("flex-2", 1), ("priority-1", -1), ("default-2", 0)):
        seq = _seq([10 + len(order)] * 8, max_tokens=1)
        seq.request_id, seq.priority = name, priority
        sched.add(seq)
        order.append(seq)
    admitted = []
    while sched.has_work:
        for c in _step(sched):
            if c.start == 0:
                admitted.append(c.seq.request_id)
            if c.seq.num_tokens > 8:  # its one token was sampled (and appended) this step
                sched.finish(c.seq, "length")
    assert admitted == ["priority-1", "default-1", "default-2", "flex-1", "flex-2"]


def test_the_pools_victim_is_the_lowest_priority():
    """Two running sequences outgrow the pool: the flex one is preempted, though it came first."""
    bm = BlockManager(6, BS)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm)
    flex, urgent = _seq(list(range(10, 22)), max_tokens=16), _seq(list(range(40, 48)), max_tokens=16)
    flex.priority, urgent.priority = 1, -1
    sched.add(flex)
    sched.add(urgent)
    while not flex.num_preemptions and not urgent.num_preemptions:
        _step(sched)
    assert flex.num_preemptions == 1 and urgent.num_preemptions == 0 and flex.status is Status.WAITING


def test_a_long_prefill_leaves_room_for_a_short_prompt_behind_it():
    """With the threshold, a short prompt arriving during a long prefill starts at the next step;
    alone, the long prompt still takes the whole budget (the cap never idles it)."""
    bm = BlockManager(256, BS)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, long_prefill_token_threshold=32), bm)
    long = _seq(list(range(1000, 1400)), max_tokens=1)
    sched.add(long)
    [alone] = _step(sched)
    assert alone.end - alone.start == 64
    short = _seq(list(range(5000, 5016)), max_tokens=1)
    sched.add(short)
    chunks = {c.seq.request_id: c for c in _step(sched)}
    assert short.request_id in chunks and chunks[short.request_id].end == 16  # all of it, this step
    assert chunks[long.request_id].end - chunks[long.request_id].start == 32  # capped: someone waited
    # without the threshold the long prompt takes the budget and the short one waits a step
    bm2 = BlockManager(256, BS)
    plain = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm2)
    long2, short2 = _seq(list(range(1000, 1400)), max_tokens=1), _seq(list(range(5000, 5016)), max_tokens=1)
    plain.add(long2)
    _step(plain)
    plain.add(short2)
    assert [c.seq for c in _step(plain)] == [long2]


def test_an_urgent_prompt_does_not_wait_for_the_prefills_admitted_before_it():
    """Two long prefills of priority 1 fill every step's budget; a short prompt of priority 0
    arriving behind them is admitted and prefilled at the next step, and its decodes go first
    after that. With equal priorities it waits for them (arrival order)."""
    def run(urgent_priority: int) -> tuple[int, bool]:
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, long_prefill_token_threshold=32),
                          BlockManager(512, BS))
        floods = [_seq(list(range(1000 * k, 1000 * k + 400)), max_tokens=4) for k in (1, 2)]
        for f in floods:
            f.priority = 1
            sched.add(f)
        _step(sched)
        short = _seq(list(range(9000, 9016)), max_tokens=4)
        short.priority = urgent_priority
        sched.add(short)
        steps = 0
        while short.num_tokens == 16:  # until its first token
            _step(sched)
            steps += 1
        return steps, all(f.num_computed < 400 for f in floods)

    assert run(0) == (1, True)  # at the next step, while both floods are still in prefill
    steps, _ = run(1)
    assert steps > 1


def test_an_urgent_prompt_gets_a_step_of_its_own_prefill_and_the_decodes():
    """A running flex prefill yields to a priority prompt, and flex prompts queued behind do not
    fill the step it yielded: the step is the urgent prefill and the decodes. The step after,
    the flex prefill goes on."""
    bm = BlockManager(512, BS)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm)
    decoding = _seq(list(range(10, 14)), max_tokens=32)
    decoding.priority = 1
    sched.add(decoding)
    _step(sched)  # its prompt in one step: it decodes from now on
    long, queued = _seq(list(range(1000, 1400)), max_tokens=1), _seq(list(range(2000, 2400)), max_tokens=1)
    long.priority = queued.priority = 1
    sched.add(long)
    _step(sched)  # the long prompt runs: a prefill in progress
    sched.add(queued)
    urgent = _seq(list(range(5000, 5016)), max_tokens=1)
    urgent.priority = -1
    sched.add(urgent)
    chunks = {id(c.seq): c for c in _step(sched)}
    assert set(chunks) == {id(urgent), id(decoding)}  # neither flex prefill shares it
    assert chunks[id(urgent)].end == 16 and chunks[id(decoding)].end - chunks[id(decoding)].start == 1
    assert queued.status is Status.WAITING
    chunks = {id(c.seq): c for c in _step(sched)}
    assert chunks[id(long)].end - chunks[id(long)].start > 1  # then the flex prefill goes on


def test_an_adapter_waiting_for_a_slot_is_not_starved_by_the_slot_holders_new_requests():
    """max_loras 1, `a` holds the slot: a request for `b` waits for it; `a`'s later requests
    wait behind `b` (they would keep the slot busy forever), the base model's do not."""
    from replica.core.adapter_slots import AdapterSlots

    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), BlockManager(64, BS), AdapterSlots(1))

    def seq(first: int, adapter: str | None, max_tokens: int) -> Sequence:
        s = _seq(list(range(first, first + 8)), max_tokens)
        s.adapter = adapter
        sched.add(s)
        return s

    a1 = seq(100, "a", 3)
    _step(sched)
    b = seq(200, "b", 2)
    a2 = seq(300, "a", 2)
    base = seq(400, None, 2)
    chunks = _step(sched)
    assert [c.seq.request_id for c in chunks] == [a1.request_id, base.request_id]  # b waits for the slot; a2 waits behind b
    assert b.status == a2.status == Status.WAITING
    while a1.num_tokens - len(a1.prompt_token_ids) < 3:
        _step(sched)
    sched.finish(a1, "length")  # a drains: b gets the slot before a2 does
    _step(sched)
    assert b.status == Status.RUNNING and a2.status == Status.WAITING
