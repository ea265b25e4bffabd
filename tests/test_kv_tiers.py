"""K/V tiers below the pool: evicted blocks move down, hits move back up, every copy
lands where the bookkeeping says, and the real engine's greedy output after a host or disk hit
equals a recompute."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.kvcache.block_manager import BlockManager, BlockTable
from replica.kvcache.kv_tiers import TierMove
from router.protocol.hashing import block_hashes
from router.protocol.media import DEVICE, DISK, HOST

BS = 4


class Recorder:
    """A listener replaying events into per-medium sets, as the index does."""

    def __init__(self) -> None:
        self.held: dict[str, set[int]] = {DEVICE: set(), HOST: set(), DISK: set()}
        self.log: list[tuple[str, str, list[int]]] = []

    def stored(self, hashes, positions, medium=DEVICE):
        self.held[medium].update(hashes)
        self.log.append(("+", medium, list(hashes)))

    def removed(self, hashes, medium=DEVICE):
        self.held[medium].difference_update(hashes)
        self.log.append(("-", medium, list(hashes)))

    def cleared(self):
        for s in self.held.values():
            s.clear()


def make(num_blocks=4, host=0, disk=0):
    bm = BlockManager(num_blocks, BS, host, disk, record_moves=True)
    rec = Recorder()
    bm.listeners.append(rec)
    return bm, rec


def run(bm, tokens, free=True):
    t = BlockTable(hashes=block_hashes(tokens, BS, 0), token_ids=tokens)
    cached = bm.allocate(t, len(tokens))
    bm.commit(t, tokens, len(tokens), 0)
    if free:
        bm.free(t)
    return t, cached


def test_evicted_blocks_move_to_host_and_come_back_as_hits():
    bm, rec = make(num_blocks=4, host=8)
    a = [1] * 8 + [2]  # 2 full blocks + 1 token: 3 blocks
    ta, _ = run(bm, a)
    a_hashes = ta.hashes[:2]
    bm.take_moves()
    run(bm, [7] * 12 + [8])  # needs 4 blocks: a's evicted
    moves = bm.take_moves()
    assert {m.src for m in moves} == {DEVICE} and {m.dst for m in moves} == {HOST}
    assert set(a_hashes) <= rec.held[HOST] and not set(a_hashes) & rec.held[DEVICE]
    t, cached = run(bm, a, free=False)
    assert cached == 8 and t.promoted == {HOST: 2}
    back = [m for m in bm.take_moves() if m.dst == DEVICE]
    assert [m.dst_slot for m in back] == t.block_ids[:2] and {m.src for m in back} == {HOST}
    assert set(a_hashes) <= rec.held[DEVICE] and not set(a_hashes) & rec.held[HOST]
    assert bm.stats.tier_hit_tokens == {HOST: 8} and bm.tier(HOST).stats.promotions == 2


def test_a_block_written_behind_is_evicted_without_a_copy():
    bm, rec = make(num_blocks=4, host=8)
    a = [1] * 8 + [2]
    ta, _ = run(bm, a)
    bm.take_moves()
    ahead = bm.plan_writeback(8, 8)  # the two cached blocks, copied while a forward pass runs
    assert [(m.src, m.dst) for m in ahead] == [(DEVICE, HOST)] * 2
    assert bm.num_available == 2, "pinned while their copy runs"
    bm.finish_writeback()
    assert bm.num_available == 4 and bm.plan_writeback(8, 8) == [], "copied once"
    run(bm, [7] * 12 + [8])  # evicts both: nothing left to copy on the step
    assert not [m for m in bm.take_moves() if m.src == DEVICE]
    assert bm.stats.writeback_hits == 2 and set(ta.hashes[:2]) <= rec.held[HOST]
    t, cached = run(bm, a)
    assert cached == 8 and t.promoted == {HOST: 2}


def test_host_overflow_spills_to_disk_then_drops_in_lru_order():
    bm, rec = make(num_blocks=2, host=1, disk=1)
    prompts = [[p] * 4 + [p + 100] for p in (1, 2, 3)]  # one full block and one token: 2 blocks each
    hashes = []
    for p in prompts:  # each evicts the one before: 1 -> host, then 1 -> disk and 2 -> host
        bm.take_moves()
        hashes.append(run(bm, p)[0].hashes[0])
    assert hashes[0] in rec.held[DISK] and hashes[1] in rec.held[HOST] and hashes[2] in rec.held[DEVICE]
    moves = bm.take_moves()  # the third prompt's: host's block goes to disk before its slot is refilled
    assert [(m.src, m.dst) for m in moves] == [(HOST, DISK), (DEVICE, HOST)]
    assert moves[0].src_slot == moves[1].dst_slot
    run(bm, [9] * 5)  # disk full too: prompt 1's block is gone
    assert hashes[0] not in set().union(*rec.held.values()) and bm.tier(DISK).stats.dropped == 1
    t, cached = run(bm, prompts[1])  # on disk now: a hit, moved back
    assert cached == 4 and t.promoted == {DISK: 1}


def test_a_lower_tier_hit_checks_the_tokens():
    bm, _ = make(num_blocks=3, host=4)
    a = [1, 2, 3, 4, 5]
    ta, _ = run(bm, a)
    run(bm, [9] * 8 + [1])  # evicts a's block to host
    forged = BlockTable(hashes=list(ta.hashes), token_ids=[4, 3, 2, 1, 5])  # same keys, other tokens
    assert bm.allocate(forged, 5) == 0


def test_clear_cache_empties_every_tier():
    bm, rec = make(num_blocks=2, host=4, disk=4)
    for p in range(4):
        run(bm, [p] * 4 + [50])
    assert any(m != DEVICE for _, _, m in bm.held_blocks())
    bm.clear_cache()
    assert bm.held_blocks() == [] and not any(rec.held.values())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 14), st.booleans(), st.integers(0, 3)), min_size=1, max_size=40),
       st.integers(3, 8), st.integers(0, 4), st.integers(0, 4))
def test_copies_always_land_where_the_bookkeeping_says(ops, pool, host, disk):
    """Replays the recorded moves on fake bytes (a block's payload is its hash, written when it
    is computed): after every operation each block in every medium holds its own payload, each
    hash lives in one medium, and the listener's view equals what the manager holds."""
    bm, rec = make(num_blocks=pool, host=host, disk=disk)
    data: dict[str, dict[int, int]] = {DEVICE: {}, HOST: {}, DISK: {}}
    rng = random.Random(0)
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(6)]
    live: list[BlockTable] = []

    def replay(moves: list[TierMove]) -> None:
        for m in moves:
            data[m.dst][m.dst_slot] = data[m.src][m.src_slot]

    for prefix, tail, keep, writeback in ops:
        if writeback:  # copies made ahead of eviction, as during a forward pass
            replay(bm.plan_writeback(writeback, 4))
            bm.finish_writeback()
        tokens = prefixes[prefix][: max(tail, 1)] + [99]
        t = BlockTable(hashes=block_hashes(tokens, BS, 0), token_ids=tokens)
        while not bm.can_allocate(t, len(tokens)) and live:
            bm.free(live.pop(0))
        if not bm.can_allocate(t, len(tokens)):
            continue
        hit = bm.allocate(t, len(tokens))
        replay(bm.take_moves())
        for i in range(hit // BS):  # a hit reads its blocks' K/V: it must be this prompt's
            assert data[DEVICE][t.block_ids[i]] == t.hashes[i]
        for i in range(hit // BS, len(tokens) // BS):  # computed now
            data[DEVICE][t.block_ids[i]] = t.hashes[i]
        bm.commit(t, tokens, len(tokens), 0)
        (live.append if keep else bm.free)(t)
        held = bm.held_blocks()
        assert len({h for h, _, _ in held}) == len(held), "a block lives in one medium"
        for h, block in bm.hash_to_block.items():
            assert data[DEVICE][block] == h
        for tier in bm.tiers:
            for h, e in tier.entries.items():
                assert data[tier.medium][e.slot] == h
        for block, slot in bm.chain.shadow.items():  # a write-behind copy is its block's K/V
            assert data[bm.tiers[0].medium][slot] == bm.block_hash[block]
        for medium in (DEVICE, HOST, DISK):
            assert rec.held[medium] == {h for h, _, m in held if m == medium}


# ---- the real engine ----------------------------------------------------------------------
from replica.engine import LLMEngine, SamplingParams  # noqa: E402
from replica.model.model_runner import ModelRunner  # noqa: E402
from tests.helpers.engine import TINY_FAMILIES, reference_greedy  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def tiny(request, tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dirs[request.param]
    return path, AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("tier", [HOST, DISK])
def test_greedy_after_a_tier_hit_equals_recompute(tiny, tier, tmp_path):
    path, ref = tiny
    block_bytes = ModelRunner.read_shape(path).bytes_per_block(BS, torch.float32)
    tiers = {"kv_host_bytes": 64 * block_bytes} if tier == HOST else {
        "kv_host_bytes": 2 * block_bytes, "kv_disk_bytes": 64 * block_bytes, "kv_disk_dir": str(tmp_path)}
    engine = LLMEngine(path, block_size=BS, num_blocks=24, **tiers)
    rng = random.Random(3)
    prompt = [rng.randrange(3, 384) for _ in range(41)]
    other = [rng.randrange(3, 384) for _ in range(60)]
    expected = reference_greedy(ref, prompt, GREEDY.max_tokens, stop_at_eos=False)
    assert engine.generate([prompt], GREEDY)[0].token_ids == expected
    engine.generate([other], GREEDY)  # 17 blocks of a 24-block pool: the prompt's blocks go down
    assert {m for _, _, m in engine.blocks.held_blocks()} >= {tier}
    again = engine.generate([prompt], GREEDY)[0]
    assert again.token_ids == expected
    assert again.num_cached_tokens == 40
    usage = engine.stats().tiers[tier]
    assert usage.promotions > 0 and usage.hit_tokens > 0 and usage.bytes_out >= usage.promotions * block_bytes
    first = engine.stats().tiers[HOST]
    assert first.written_behind > 0, "some evictions found their copy made during a forward pass"
    assert not list(tmp_path.iterdir()), "the disk tier's file is unlinked once mapped"
