"""What the router hands the policy (router.decider), as pure logic: which replicas get scored,
how a missing heartbeat is read, how fallbacks are ranked. The load table is filled by hand
(no Redis); its Redis side is tested in tests/test_redis_index.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.decider import Decider, InflightPrefixes
from router.index.redis_index import Lookup, RedisConfig, RedisIndex, ReplicaEntry
from router.load_table import LoadTable
from router.policy import RouteRequest, make_policy

BS = 16


def _table(loads: dict[str, dict[str, int]]) -> LoadTable:
    table = LoadTable(RedisIndex(RedisConfig("redis://127.0.0.1:1/0", timeout_s=0.01)), refresh_s=60.0, seed=0)
    table._loads = loads
    table.updated_at = time.monotonic()
    return table


def _load(running: int = 0, waiting: int = 0, pending: int = 0) -> dict[str, int]:
    return {"running": running, "waiting": waiting, "pending_prefill_tokens": pending,
            "free_blocks": 100, "cached_blocks": 0, "capacity_blocks": 100}


def _score(decider: Decider, ids: list[str], look: Lookup, hashes: list[int] | None = None, tokens: int = 256):
    route = RouteRequest(hashes or list(range(tokens // BS)), tokens, BS, None)

    async def run():
        try:
            return decider.score(route, ids, look, lambda rid: 0)
        finally:
            await decider.loads.close()

    return asyncio.run(run())


def test_missing_heartbeat_is_never_idle():
    """b's heartbeat expired (a stalled replica): it must not look cheaper than busy ones."""
    table = _table({"a": _load(running=4, pending=900), "c": _load(running=2)})
    decider = Decider(make_policy("affinity", seed=0), table, InflightPrefixes(3.0), sampled=4)
    routed = _score(decider, ["a", "b", "c"], Lookup(None))
    assert routed.decision.replica_id == "c"
    assert routed.ranked[-1] == "b"  # ranked after the busiest known replica
    assert table.pessimistic()["running"] == 4 and table.pessimistic()["waiting"] == 1


def test_only_matched_session_and_sampled_replicas_are_scored():
    ids = [f"r{i}" for i in range(200)]
    table = _table({rid: _load() for rid in ids})
    decider = Decider(make_policy("affinity", seed=0), table, InflightPrefixes(3.0), sampled=4)
    look = Lookup("r150", {"r7": ReplicaEntry(10), "r9": ReplicaEntry(3)})
    routed = _score(decider, ids, look)
    assert {"r7", "r9", "r150"} <= set(routed.ranked)
    assert len(routed.ranked) <= 3 + 4
    assert routed.decision.replica_id == "r7"  # deepest match, equal loads


def test_fallbacks_ranked_by_the_policys_cost():
    ids = ["a", "b", "c", "d"]
    table = _table({"a": _load(running=1), "b": _load(running=6), "c": _load(running=3), "d": _load()})
    policy = make_policy("affinity", seed=0)
    decider = Decider(policy, table, InflightPrefixes(3.0), sampled=4)
    look = Lookup(None, {"a": ReplicaEntry(8)})
    routed = _score(decider, ids, look)
    route = RouteRequest(list(range(16)), 256, BS, None)
    views = {v.replica_id: v for v in (decider._view(rid, routed.matched.get(rid, 0), 0, table.pessimistic()) for rid in ids)}
    rest = routed.ranked[1:]
    assert [policy.cost(route, views[r]) for r in rest] == sorted(policy.cost(route, views[r]) for r in rest)
    assert routed.ranked[-1] == "b"


def test_live_candidates_only():
    """The index may still list a replica Ray no longer offers (dead, not yet collected)."""
    table = _table({"a": _load(), "b": _load()})
    decider = Decider(make_policy("affinity", seed=0), table, InflightPrefixes(3.0), sampled=4)
    routed = _score(decider, ["a", "b"], Lookup("gone", {"gone": ReplicaEntry(16)}))
    assert "gone" not in routed.ranked and routed.decision.replica_id in ("a", "b")


def test_cache_blind_baselines_see_the_whole_fleet():
    """random and least-loaded choose over every replica, as in the simulator: least-loaded
    finds the one idle replica among 200 even though nothing matched it and sampling would
    rarely draw it."""
    ids = [f"r{i}" for i in range(200)]
    table = _table({rid: _load(running=3, pending=500) for rid in ids} | {"r123": _load()})
    decider = Decider(make_policy("least-loaded", seed=0), table, InflightPrefixes(3.0), sampled=4)
    routed = _score(decider, ids, Lookup(None, {"r7": ReplicaEntry(10)}))
    assert routed.decision.replica_id == "r123"
    assert len(routed.ranked) == 200
    seen = set()
    random_decider = Decider(make_policy("random", seed=1), table, InflightPrefixes(3.0), sampled=4)
    for _ in range(400):
        seen.add(_score(random_decider, ids, Lookup(None)).decision.replica_id)
    assert len(seen) > 100  # uniform over 200, not over a handful of sampled ones


def test_the_lookups_tier_split_reaches_the_policy():
    """A match the index reports partly in a lower tier is scored with its copy cost: between
    two idle replicas holding the same 16 blocks, the one holding them in its pool wins."""
    from router.policy import AffinityPolicy

    class Recording(AffinityPolicy):
        def decide(self, request, replicas, session_replica=None):
            self.seen = {v.replica_id: v for v in replicas}
            return super().decide(request, replicas, session_replica)

    policy = Recording(seed=0)
    decider = Decider(policy, _table({"pool": _load(), "tiers": _load()}), InflightPrefixes(3.0), sampled=4)
    look = Lookup(None, {"tiers": ReplicaEntry(16, tier_blocks={"host": 10, "disk": 2}), "pool": ReplicaEntry(16)})
    routed = _score(decider, ["pool", "tiers"], look)
    assert routed.decision.replica_id == "pool" and routed.ranked == ["pool", "tiers"]
    tiers = policy.seen["tiers"]
    assert (tiers.matched_blocks, tiers.host_blocks, tiers.disk_blocks, tiers.device_blocks) == (16, 10, 2, 4)


@pytest.mark.parametrize("name", ["affinity", "affinity-pull"])
def test_a_lora_request_prefers_the_replica_holding_its_adapter(name):
    """Equal load, no prefix anywhere: the replica whose heartbeat lists the adapter as resident
    wins over one that would read it from disk (priced at its measured load time), under both
    affinity policies (the default's costs once left the adapter out); a base-model request,
    and a replica that reports no reads yet (lora_load_ms 0), pay nothing."""
    table = _table({"a": {**_load(), "lora_resident": "poet@11 tutor@22", "lora_load_ms": 60},
                    "b": {**_load(), "lora_resident": "sql@33", "lora_load_ms": 60},
                    "v": {**_load(), "lora_resident": "", "lora_load_ms": 0}})
    policy = make_policy(name, seed=0)
    decider = Decider(policy, table, InflightPrefixes(3.0), sampled=4)
    views = {v: decider._view(v, 0, 0, {}, None, "tutor@22") for v in ("a", "b", "v")}
    assert [views[v].adapter_resident for v in ("a", "b", "v")] == [True, False, None]
    assert views["b"].adapter_load_s == 0.06
    route = RouteRequest(list(range(16)), 256, BS, None, "tutor@22")
    costs = {v: policy.cost(route, views[v]) for v in views}
    assert costs["a"] == costs["v"] < costs["b"]
    base = RouteRequest(list(range(16)), 256, BS, None)
    assert policy.cost(base, views["a"]) == policy.cost(base, views["b"])
    assert make_policy(name, seed=0, adapter_weight=0).cost(route, views["b"]) == costs["a"]
    ranked = policy.rank(route, list(views.values()))  # the costs decide() compares
    assert ranked[-1].replica_id == "b", [v.replica_id for v in ranked]

    async def run():
        try:
            return [decider.score(route, ["a", "b"], Lookup(None), lambda rid: 0).decision.replica_id for _ in range(20)]
        finally:
            await table.close()

    assert set(asyncio.run(run())) == {"a"}
