"""Routing policies and the in-memory prefix index: pure logic, no simulator."""

from __future__ import annotations

import pytest

from router.index.memory_index import InMemoryIndex
from router.policy import POLICIES, HashRing, ReplicaView, RouteRequest, make_policy, session_key

BS = 512


def request(blocks: int, session: str | None = None, first: int = 1000) -> RouteRequest:
    return RouteRequest(list(range(first, first + blocks)), blocks * BS, BS, session)


def idle(n: int) -> list[ReplicaView]:
    return [ReplicaView(f"r{i}", capacity_blocks=1000, free_blocks=1000) for i in range(n)]


# ---- registry -----------------------------------------------------------------------------


def test_registry_names():
    assert set(POLICIES) == {"affinity", "affinity-pull", "prefix", "session", "pow2", "random", "least-loaded"}
    for name in POLICIES:
        assert make_policy(name, seed=1).name == name


def test_bad_policy_name_lists_valid_ones():
    with pytest.raises(ValueError) as e:
        make_policy("round-robin")
    for name in POLICIES:
        assert name in str(e.value)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_no_live_replicas_is_an_error(name):
    with pytest.raises(ValueError):
        make_policy(name, seed=0).choose(request(4), [])


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_single_replica_always_chosen(name):
    d = make_policy(name, seed=0).choose(request(4, "s"), idle(1), "r0")
    assert d.replica_id == "r0"
    assert d.reason in ("session", "prefix", "load", "fallback")


# ---- affinity -----------------------------------------------------------------------------


def test_affinity_keeps_session_on_its_replica():
    reps = idle(4)
    reps[2].running = 2  # a little busier than the others, still fine
    d = make_policy("affinity", seed=0).choose(request(8, "chat-1"), reps, session_replica="r2")
    assert (d.replica_id, d.reason) == ("r2", "session")


def test_affinity_leaves_overloaded_session_replica():
    reps = idle(4)
    reps[2].pending_prefill_tokens = 200_000
    reps[2].waiting = 10
    d = make_policy("affinity", seed=0).choose(request(8, "chat-1"), reps, session_replica="r2")
    assert d.replica_id != "r2"
    assert d.reason == "load"


def test_affinity_ignores_dead_session_replica():
    d = make_policy("affinity", seed=0).choose(request(8, "chat-1"), idle(3), session_replica="gone")
    assert d.replica_id in {"r0", "r1", "r2"}
    assert d.reason == "load"


def test_affinity_new_session_goes_where_the_prefix_is():
    reps = idle(4)
    reps[3].matched_blocks = 20
    reps[3].running = 3  # busier, but 20 cached blocks save far more than 3 decodes cost
    d = make_policy("affinity", seed=0).choose(request(24, "new"), reps)
    assert (d.replica_id, d.reason, d.matched_blocks) == ("r3", "prefix", 20)


def test_affinity_spreads_when_prefix_holder_is_overloaded():
    reps = idle(4)
    reps[1].matched_blocks = 20
    reps[1].pending_prefill_tokens = 100_000  # ~14 s of queue vs 12k tokens to recompute
    reps[1].waiting = 8
    d = make_policy("affinity", seed=0).choose(request(24), reps)
    assert d.replica_id != "r1"
    assert d.reason == "load"


def test_affinity_cold_request_goes_to_least_loaded():
    reps = idle(3)
    reps[0].pending_prefill_tokens = 30_000
    reps[2].pending_prefill_tokens = 60_000
    d = make_policy("affinity", seed=0).choose(request(6), reps)
    assert (d.replica_id, d.reason) == ("r1", "load")


def test_affinity_hot_prefix_spreads_over_several_replicas():
    """A burst of requests sharing a 16-block prefix, none finishing: the first holder takes
    them until its queue outweighs the saved prefill, then a second replica caches it, etc."""
    policy = make_policy("affinity", seed=0)
    reps = idle(4)
    holders: set[str] = set()
    counts = dict.fromkeys((v.replica_id for v in reps), 0)
    for i in range(60):
        req = RouteRequest(list(range(16)) + [10_000 + i], 17 * BS, BS)
        for v in reps:
            v.matched_blocks = 16 if v.replica_id in holders else 0
        d = policy.choose(req, reps)
        v = next(r for r in reps if r.replica_id == d.replica_id)
        v.pending_prefill_tokens += req.num_prompt_tokens - d.matched_blocks * BS
        v.waiting += 1
        holders.add(d.replica_id)
        counts[d.replica_id] += 1
    assert len(holders) >= 2
    assert max(counts.values()) < 60  # not everything on one replica
    assert sum(c >= 5 for c in counts.values()) >= 2  # and each holder serves several hits


def test_affinity_is_reproducible_with_a_seed():
    def run(seed):
        p = make_policy("affinity", seed=seed)
        return [p.choose(request(4, first=i * 10), idle(8)).replica_id for i in range(50)]

    assert run(7) == run(7)


# ---- baselines ----------------------------------------------------------------------------


def test_prefix_policy_follows_the_longest_match_even_when_overloaded():
    reps = idle(3)
    reps[0].matched_blocks = 5
    reps[0].pending_prefill_tokens = 10**6
    reps[2].matched_blocks = 3
    d = make_policy("prefix", seed=0).choose(request(8), reps)
    assert (d.replica_id, d.reason, d.matched_blocks) == ("r0", "prefix", 5)


def test_prefix_policy_breaks_ties_by_load():
    reps = idle(3)
    for v in reps:
        v.matched_blocks = 2
    reps[0].pending_prefill_tokens = 900
    reps[1].pending_prefill_tokens = 100
    reps[2].pending_prefill_tokens = 500
    assert make_policy("prefix", seed=0).choose(request(8), reps).replica_id == "r1"


def test_least_loaded_picks_min_pending_work():
    reps = idle(3)
    reps[0].pending_prefill_tokens = 10
    reps[1].pending_prefill_tokens = 0
    reps[1].running = 9
    reps[2].pending_prefill_tokens = 5
    assert make_policy("least-loaded", seed=0).choose(request(2), reps).replica_id == "r1"


def test_pow2_prefers_the_less_busy_of_two():
    reps = idle(2)
    reps[0].running, reps[0].waiting = 5, 3
    p = make_policy("pow2", seed=3)
    assert {p.choose(request(2), reps).replica_id for _ in range(20)} == {"r1"}


def test_random_is_seeded_and_uniform_enough():
    def picks(seed):
        p = make_policy("random", seed=seed)
        return [p.choose(request(2), idle(4)).replica_id for _ in range(400)]

    assert picks(1) == picks(1)
    assert picks(1) != picks(2)
    counts = {r: picks(1).count(r) for r in ("r0", "r1", "r2", "r3")}
    assert min(counts.values()) > 60


# ---- session / consistent hashing ---------------------------------------------------------


def test_session_policy_is_sticky_and_order_independent():
    p = make_policy("session", seed=0)
    reps = idle(8)
    first = p.choose(request(3, "user-42"), reps)
    assert first.reason == "session"
    for _ in range(5):
        assert p.choose(request(5, "user-42"), list(reversed(reps))).replica_id == first.replica_id


def test_session_policy_without_session_hashes_the_first_block():
    p = make_policy("session", seed=0)
    reps = idle(8)
    a = p.choose(RouteRequest([77, 1, 2], 3 * BS, BS), reps)
    b = p.choose(RouteRequest([77, 9], 2 * BS, BS), reps)
    assert a.replica_id == b.replica_id


def test_consistent_hash_moves_only_the_removed_replicas_keys():
    ids = [f"r{i}" for i in range(8)]
    keys = [session_key(request(1, f"user-{i}")) for i in range(4000)]
    before = {k: HashRing(ids).lookup(k) for k in keys}
    ring = HashRing([r for r in ids if r != "r3"])
    after = {k: ring.lookup(k) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == "r3" for k in moved)  # nobody else's keys move
    assert 0.05 < len(moved) / len(before) < 0.25  # about 1/8


def test_consistent_hash_adding_a_replica_only_takes_keys_for_it():
    ids = [f"r{i}" for i in range(8)]
    p = make_policy("session", seed=0)
    sessions = [f"s{i}" for i in range(3000)]
    reps8, reps9 = idle(8), idle(9)
    before = {s: p.choose(request(1, s), reps8).replica_id for s in sessions}
    after = {s: p.choose(request(1, s), reps9).replica_id for s in sessions}
    moved = [s for s in sessions if before[s] != after[s]]
    assert all(after[s] == "r8" for s in moved)
    assert 0.04 < len(moved) / len(sessions) < 0.22  # about 1/9
    assert set(before.values()) == set(ids)


# ---- in-memory index ----------------------------------------------------------------------


def test_index_match_counts_leading_blocks_only():
    idx = InMemoryIndex()
    idx.stored("a", [1, 2, 3])
    idx.stored("b", [1, 3])  # holds block 3 but not 2: only the first block counts
    idx.stored("c", [9])
    assert idx.match([1, 2, 3, 4], ["a", "b", "c", "d"]) == {"a": 3, "b": 1, "c": 0, "d": 0}
    assert idx.match([], ["a"]) == {"a": 0}
    assert idx.match([1, 2], ["b"]) == {"b": 1}  # only the replicas asked about


def test_index_removed_and_clear():
    idx = InMemoryIndex()
    idx.stored("a", [1, 2, 3])
    idx.stored("b", [1, 2])
    idx.removed("a", [2])
    assert idx.match([1, 2, 3], ["a", "b"]) == {"a": 1, "b": 2}
    idx.removed("zzz", [1])  # unknown replica: no effect
    idx.clear("b")
    assert idx.match([1, 2, 3], ["a", "b"]) == {"a": 1, "b": 0}
    idx.clear("a")
    assert len(idx) == 0
    idx.stored("a", [1])
    assert idx.match([1], ["a"]) == {"a": 1}


@pytest.mark.parametrize("name", ["random", "least-loaded", "pow2"])
def test_cache_blind_baselines_rank_fallbacks_without_the_cache(name):
    """When the chosen replica is full, Ray takes the next ranked one: a baseline that ranked by
    cached blocks would follow the cache on overflow and stop being cache-blind."""
    views = [ReplicaView(f"r{i}", matched_blocks=8 if i == 5 else 0, capacity_blocks=1000, free_blocks=1000)
             for i in range(8)]
    p = make_policy(name, seed=0)
    firsts = {p.rank(request(8), views)[0].replica_id for _ in range(40)}
    if name == "random":
        assert len(firsts) > 1  # random order, not the holder first every time
    else:
        assert p.rank(request(8), views)[0].replica_id == "r0"  # equal loads: list order, not the cache
    busy = [ReplicaView("a", matched_blocks=8, waiting=5), ReplicaView("b")]
    if name != "random":
        assert [v.replica_id for v in p.rank(request(8), busy)] == ["b", "a"]


# ---- affinity: balance tolerance, matches past the publish depth, route reasons ---------------


def test_affinity_balance_tie_break_does_not_override_a_small_prefix():
    """r0 holds 2 of the prompt's 24 blocks and was sent more work recently than r1. The
    recent-work tie-break only ties replicas whose costs differ by load noise (0.05 x the
    prompt), so the saved prefill (4 x 2 blocks) keeps the request on the holder. At the old
    0.5 the two were 'tied' and the request went to r1, losing the hit."""
    p = make_policy("affinity", seed=0)
    reps = idle(2)
    for i in range(8):  # r0 got several cold prompts lately
        p.commit(request(24, first=50_000 + 100 * i), "r0", 0, 2)
    reps[0].matched_blocks = 2
    d = p.choose(request(24), reps)
    assert (d.replica_id, d.reason, d.matched_blocks) == ("r0", "prefix", 2)
    # with equal costs the tie-break still spreads work: a cold prompt goes to the one sent less
    assert p.choose(request(24, first=90_000), idle(2)).replica_id == "r1"


def capped(prompt_blocks: int, depth: int = 64) -> RouteRequest:
    """A prompt longer than the publish depth: the router hashes its first `depth` blocks only."""
    return RouteRequest(list(range(1000, 1000 + depth)), prompt_blocks * BS + 1, BS)


def test_affinity_prices_a_match_at_the_publish_depth_as_reaching_further():
    """A 120-block prompt of which the router sees 64: r0 matches all 64 and has a queue, r1 is
    idle and holds nothing. r0 most likely holds the whole prompt (a conversation's previous
    turn); priced as saving 64 blocks only, its 150k-token queue looked dearer than recomputing
    120 blocks on r1."""
    p = make_policy("affinity", seed=0)
    req = capped(120)
    holder = ReplicaView("r0", matched_blocks=64, waiting=3, pending_prefill_tokens=150_000)
    assert p.beyond(req, 64) == 120 and p.beyond(req, 63) == 63
    assert p.cost(req, holder) == pytest.approx(4 * 1 + 150_000 + 256 * 3)  # the prompt's trailing token
    d = p.choose(req, [holder, ReplicaView("r1")])
    assert (d.replica_id, d.reason) == ("r0", "prefix")
    # a prompt that ends within the depth is matched exactly: nothing assumed past it
    short = RouteRequest(list(range(1000, 1040)), 40 * BS + 1, BS)
    assert p.beyond(short, 40) == 40
    # beyond_depth=0 prices the seen match only (the old rule)
    assert make_policy("affinity", seed=0, beyond_depth=0).beyond(req, 64) == 64


def test_beyond_depth_continues_in_the_tier_the_match_ends_in():
    p = make_policy("affinity", seed=0)
    req = capped(120)
    on_host = ReplicaView("r0", matched_blocks=64, host_blocks=8)
    usable, copy = p.own_hits(req, on_host)
    assert usable == 120
    from router.protocol.media import HOST
    assert copy == pytest.approx(p.transfer.tier_tokens_equiv(HOST, (8 + 56) * BS))


def test_route_reasons_are_one_list_with_stale():
    from router.decider import Decider, InflightPrefixes
    from router.policy import REASONS
    from router.sim.loads import SimLoadTable

    assert set(REASONS) == {"session", "prefix", "load", "fallback", "pull", "stale", "slo"}

    class Rep:
        def heartbeat(self, now):
            return {"running": 0, "waiting": 0, "pending_prefill_tokens": 0}

    loads = SimLoadTable({"r0": Rep(), "r1": Rep()}, lambda: 0.0)
    loads.sync()
    decider = Decider(make_policy("affinity", seed=0), loads, InflightPrefixes(5.0, clock=lambda: 0.0))
    routed = decider.degraded(request(4), ["r0", "r1"], lambda rid: 0)
    assert routed.decision.reason == "stale" and routed.decision.reason in REASONS
