"""BlockManager: prefix reuse, LRU eviction, events, and invariants under random operations."""

from hypothesis import given, settings
from hypothesis import strategies as st

from replica.kvcache.block_manager import BlockManager, BlockTable
from router.protocol.hashing import block_hashes

BS = 4


def make(num_blocks=8):
    bm = BlockManager(num_blocks, BS)
    rec = _Listener()
    bm.listeners.append(rec)
    return bm, rec


class _Listener:
    def __init__(self):
        self.stored_hashes: list[int] = []
        self.positions: list[int] = []
        self.removed_hashes: list[int] = []
        self.cleared_count = 0

    def stored(self, hashes, positions):
        self.stored_hashes += hashes
        self.positions += positions

    def removed(self, hashes):
        self.removed_hashes += hashes

    def cleared(self):
        self.cleared_count += 1


def run_prompt(bm, tokens):
    t = BlockTable(hashes=block_hashes(tokens, BS, 0))
    cached = bm.allocate(t, len(tokens))
    bm.commit(t, tokens, len(tokens), 0)
    return t, cached


def test_reuse_longest_prefix_and_keep_last_token():
    bm, rec = make()
    t1, c1 = run_prompt(bm, list(range(10)))  # 2 full blocks
    assert c1 == 0 and rec.stored_hashes == block_hashes(list(range(10)), BS, 0)
    assert rec.positions == [0, 1]
    t2, c2 = run_prompt(bm, list(range(8)) + [99, 98])
    assert c2 == 8 and t2.block_ids[:2] == t1.block_ids[:2]
    assert bm.ref_count[t1.block_ids[0]] == 2
    bm.free(t1)
    bm.free(t2)
    t3, c3 = run_prompt(bm, list(range(8)))  # exactly 2 blocks: the last token must be computed
    assert c3 == 4


def test_lru_eviction_order_and_events():
    bm, rec = make(num_blocks=4)
    a, _ = run_prompt(bm, [1] * 8)
    bm.free(a)  # 2 cached blocks, tail freed first so it is evicted first
    b, _ = run_prompt(bm, [2] * 12)  # needs 3 blocks: 2 free + 1 evicted
    assert rec.removed_hashes == [block_hashes([1] * 8, BS, 0)[1]]
    assert bm.stats.evictions == 1
    t = BlockTable(hashes=block_hashes([1] * 8 + [3], BS, 0))
    assert bm.can_allocate(t, 9) is False  # b holds 3 blocks, a's head is cached: 1 available, 3 needed
    bm.free(b)
    assert bm.allocate(t, 9) == 4


def test_referenced_blocks_are_never_evicted():
    bm, _ = make(num_blocks=3)
    a, _ = run_prompt(bm, [1] * 12)
    t = BlockTable(hashes=block_hashes([2] * 4, BS, 0))
    assert not bm.can_allocate(t, 4)
    assert set(a.block_ids) == {0, 1, 2} and all(bm.ref_count[b] == 1 for b in a.block_ids)


def test_clear_cache_forgets_every_hash_even_in_use():
    bm, rec = make()
    a, _ = run_prompt(bm, [5] * 8)
    bm.free(a)
    b, _ = run_prompt(bm, [6] * 8)  # still running
    assert bm.num_cached == 2
    assert bm.clear_cache() == 4
    assert rec.cleared_count == 1 and not bm.hash_to_block
    c, cached = run_prompt(bm, [6] * 8 + [1])  # in-use K/V can no longer be hit
    assert cached == 0
    bm.free(b)
    assert bm.num_cached == 0 and bm.num_free == bm.num_blocks - 3  # b's blocks went back unhashed
    bm.free(c)
    assert bm.num_cached == 2  # only the recomputed blocks are cached


def test_decode_blocks_become_cached():
    bm, rec = make()
    tokens = [3] * 6
    t, _ = run_prompt(bm, tokens)
    tokens += [4, 5]
    bm.append(t, len(tokens))
    bm.commit(t, tokens, len(tokens), 0)
    assert rec.stored_hashes == block_hashes(tokens, BS, 0)
    assert bm.cached_hashes() == [(h, i) for i, h in enumerate(block_hashes(tokens, BS, 0))]


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "free", "grow"]), st.integers(0, 5), st.integers(1, 14)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_invariants_under_random_operations(operations):
    bm, rec = make(num_blocks=10)
    live: dict[int, tuple[BlockTable, list[int]]] = {}
    for op, key, n in operations:
        if op == "alloc" and key not in live:
            tokens = [key % 3] * n  # few distinct prefixes, so hits and twins happen
            t = BlockTable(hashes=block_hashes(tokens, BS, 0))
            if bm.can_allocate(t, n):
                bm.allocate(t, n)
                bm.commit(t, tokens, n, 0)
                live[key] = (t, tokens)
        elif op == "free" and key in live:
            bm.free(live.pop(key)[0])
        elif op == "grow" and key in live:
            t, tokens = live[key]
            if bm.can_append(t, len(tokens) + 1):
                tokens.append(n)
                bm.append(t, len(tokens))
                bm.commit(t, tokens, len(tokens), 0)
        _check(bm, live)
    for t, _ in live.values():
        bm.free(t)
    _check(bm, {})
    assert bm.num_used == 0
    # each eviction matches exactly one earlier store, and the net result is what is cached
    assert set(bm.hash_to_block) == _net_cached(rec)


def _net_cached(rec):
    """Replay the event stream: stored +1, removed -1; each hash must end at 0 or 1."""
    counts: dict[int, int] = {}
    for h in rec.stored_hashes:
        counts[h] = counts.get(h, 0) + 1
    for h in rec.removed_hashes:
        counts[h] -= 1
    assert all(v in (0, 1) for v in counts.values()), "a hash was reported removed more often than stored"
    return {h for h, v in counts.items() if v == 1}


def _check(bm: BlockManager, live):
    free = set(bm.pool.free_ids)
    lru = set(bm.pool.lru)
    assert not free & lru
    referenced = {b for b in range(bm.num_blocks) if bm.ref_count[b] > 0}
    assert not referenced & (free | lru), "a block is both free and referenced"
    assert free | lru | referenced == set(range(bm.num_blocks))
    assert all(c >= 0 for c in bm.ref_count)
    expected = [0] * bm.num_blocks
    for t, _ in live.values():
        for b in t.block_ids:
            expected[b] += 1
    assert expected == bm.ref_count
    for h, b in bm.hash_to_block.items():
        assert bm.block_hash[b] == h
    assert all(bm.block_hash[b] is not None for b in lru)


def test_hash_hit_with_other_tokens_is_refused():
    """xxh64 is not collision resistant: a hit counts only if the cached block holds our tokens."""
    bm, _ = make()
    tokens = list(range(10))
    a = BlockTable(hashes=block_hashes(tokens, BS, 0), token_ids=tokens)
    bm.allocate(a, len(tokens))
    bm.commit(a, tokens, len(tokens), 0)
    assert bm.block_tokens[a.block_ids[0]] == (0, 1, 2, 3)
    forged = [0, 1, 2, 3, 9, 9, 9, 9, 8, 8]  # same first block; the second one's key is forged
    b = BlockTable(hashes=list(a.hashes), token_ids=forged)
    assert bm.allocate(b, len(forged)) == 4  # first block shared, the colliding one recomputed
    assert b.block_ids[0] == a.block_ids[0] and b.block_ids[1] != a.block_ids[1]
    assert bm.stats.collisions == 1
    c = BlockTable(hashes=list(a.hashes))  # no tokens (the simulator): hits are trusted
    assert bm.allocate(c, len(tokens)) == 8
