"""Routing when the index does not answer (router.decider.Decider.degraded), as pure logic:
the router still uses what it knows itself (prefixes and sessions it routed, its load table,
its own in-flight counts) and labels the decision `stale`. The load table is filled by hand
(no Redis); the real outage is in tests/test_router_e2e.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.decider import Decider, InflightPrefixes, Routed, SessionMemory
from router.index.redis_index import RedisConfig, RedisIndex
from router.load_table import LoadTable
from router.policy import RouteRequest, make_policy
from router.protocol.messages import RouteDecision

BS = 16
IDS = [f"r{i}" for i in range(8)]


def _load(running: int = 0, waiting: int = 0, pending: int = 0) -> dict[str, int]:
    return {"running": running, "waiting": waiting, "pending_prefill_tokens": pending,
            "free_blocks": 100, "cached_blocks": 0, "capacity_blocks": 100}


def _decider(loads: dict[str, dict[str, int]] | None = None, fresh: bool = True, policy: str = "affinity",
             inflight: InflightPrefixes | None = None) -> Decider:
    """`fresh=False`: the table was last refreshed long ago (Redis away), so every load is unknown."""
    table = LoadTable(RedisIndex(RedisConfig("redis://127.0.0.1:1/0", timeout_s=0.01)), refresh_s=60.0, seed=0)
    table._loads = loads if loads is not None else {rid: _load() for rid in IDS}
    table.updated_at = time.monotonic() - (0 if fresh else 60)
    return Decider(make_policy(policy, seed=0), table, inflight or InflightPrefixes(3.0, keep_s=30.0), sampled=4,
                   sessions=SessionMemory())


def _route(hashes: list[int], session: str | None = None) -> RouteRequest:
    return RouteRequest(hashes, len(hashes) * BS + 5, BS, session)


def _degraded(decider: Decider, route: RouteRequest, ids: list[str] = IDS, queue=None) -> Routed:
    async def run():
        try:
            return decider.degraded(route, ids, queue or (lambda rid: 0))
        finally:
            await decider.loads.close()

    return asyncio.run(run())


def _sent(decider: Decider, route: RouteRequest, replica: str) -> None:
    """What on_request_routed records for a request Ray sent to `replica`."""
    decider.remember(Routed(route, RouteDecision("affinity", "load", replica), [replica]), replica)


def test_session_keeps_its_replica_with_every_load_unknown():
    decider = _decider(fresh=False)
    _sent(decider, _route([1, 2, 3], "chat-1"), "r5")
    for turn in range(3):  # later turns of the conversation, Redis still away
        routed = _degraded(decider, _route([1, 2, 3, 4 + turn], "chat-1"))
        assert routed.decision.replica_id == "r5"
        assert routed.decision.reason == "stale"
        assert routed.decision.matched_blocks == 3
        _sent(decider, routed.route, "r5")


def test_prefix_routed_before_the_outage_is_found_beyond_the_fresh_window():
    """A system prompt this router sent 0.1 s ago with a 0.05 s fresh window: the index path
    no longer counts it, the degraded path still does, for a new session."""
    decider = _decider(fresh=False, inflight=InflightPrefixes(0.05, keep_s=30.0))
    system = list(range(100, 110))
    _sent(decider, _route(system + [7], "a"), "r3")
    time.sleep(0.1)
    assert decider.inflight.match(system) == {}
    routed = _degraded(decider, _route(system + [8], "b"))
    assert routed.decision.replica_id == "r3" and routed.matched == {"r3": 10}


def test_a_conversation_matches_its_home_after_its_system_prompt_went_elsewhere():
    """Sessions sharing a system prompt live on different replicas: the prompt's blocks were
    last sent to r6, yet r2, which holds this conversation's whole history, matches deepest."""
    decider = _decider(fresh=False)
    system = list(range(300, 306))
    _sent(decider, _route(system + [1, 2, 3], "chat-a"), "r2")
    _sent(decider, _route(system + [7], "chat-b"), "r6")
    routed = _degraded(decider, _route(system + [1, 2, 3, 4], "chat-a"))
    assert routed.matched["r2"] == 9 and routed.matched["r6"] == 6
    assert routed.decision.replica_id == "r2"


def test_prefix_and_session_memory_end():
    decider = _decider(fresh=False, inflight=InflightPrefixes(0.01, keep_s=0.05))
    decider.sessions = SessionMemory(ttl_s=0.05)
    _sent(decider, _route([1, 2, 3], "chat-1"), "r5")
    time.sleep(0.1)
    routed = _degraded(decider, _route([1, 2, 3, 4], "chat-1"))
    assert routed.matched == {} and decider.sessions.get("chat-1") is None


def test_memory_stays_bounded():
    sessions = SessionMemory(max_entries=3)
    for i in range(10):
        sessions.remember(f"s{i}", "r0")
    assert [sessions.get(f"s{i}") for i in (0, 6, 7, 8, 9)] == [None, None, "r0", "r0", "r0"]


def test_own_queue_counts_tell_unknown_replicas_apart():
    """Every heartbeat unknown, nothing remembered: the replica this router sent the fewest
    requests to wins, and the rest are ranked by the same counts (never all equal)."""
    decider = _decider(fresh=False, policy="least-loaded")
    queue = {rid: 5 for rid in IDS} | {"r6": 1}
    routed = _degraded(decider, _route([9, 9, 9]), queue=queue.get)
    assert routed.decision.replica_id == "r6" and routed.decision.reason == "stale"


def test_fresh_load_table_still_balances():
    """A lookup timed out but the load table is fresh: the prefix holder, far over its share,
    loses to an idle replica, as it would with the index."""
    loads = {rid: _load() for rid in IDS} | {"r2": _load(running=30, waiting=40, pending=20000)}
    decider = _decider(loads)
    system = list(range(200, 204))
    _sent(decider, _route(system + [1], "a"), "r2")
    routed = _degraded(decider, _route(system + [2], "b"))
    assert routed.decision.replica_id != "r2"
    assert "r2" in routed.ranked[1:]  # still a fallback, ranked by cost


def test_dead_replicas_are_not_chosen():
    decider = _decider(fresh=False)
    _sent(decider, _route([1, 2, 3], "chat-1"), "gone")
    routed = _degraded(decider, _route([1, 2, 3, 4], "chat-1"), ids=["r0", "r1"])
    assert routed.decision.replica_id in ("r0", "r1") and set(routed.ranked) <= {"r0", "r1"}


def test_a_timed_out_lookup_keeps_the_load_table(redis_server):
    """Real redis-server, paused with CLIENT PAUSE: the lookup misses its 50 ms and the index
    cools down, but the client survives (Redis is slow, not gone), so the load table still
    refreshes during the cool-down and the degraded decision sees real loads."""
    import uuid

    import redis

    from router.index.redis_index import IndexUnavailable
    from router.protocol.redis_schema import LOAD_FIELDS, Heartbeat, RedisKeys

    prefix = f"deg-{uuid.uuid4().hex[:6]}"
    keys = RedisKeys(prefix)
    sync = redis.Redis.from_url(redis_server.url)
    busy = {"running": 30, "waiting": 40, "pending_prefill_tokens": 20000}
    for rid in ("r0", "r1"):
        load = busy if rid == "r0" else {}
        sync.hset(keys.heartbeat(rid), mapping={f: load.get(f, getattr(Heartbeat(), f)) for f in LOAD_FIELDS})

    async def scenario():
        index = RedisIndex(RedisConfig(redis_server.url, prefix, timeout_s=0.05, cooldown_s=30.0, timeouts_to_trip=1))
        table = LoadTable(index, refresh_s=60.0, seed=0)
        decider = Decider(make_policy("affinity", seed=0), table, InflightPrefixes(3.0, keep_s=30.0))
        table._watched = ["r0", "r1"]  # what watch() sets, without its background refresh
        try:
            await index.lookup([1, 2, 3])  # connected, script loaded
            sync.client_pause(500)  # every other client's commands wait 0.5 s from now
            with pytest.raises(IndexUnavailable):
                await index.lookup([1, 2, 3])
            await asyncio.to_thread(sync.ping)  # answered once the pause is over
            with pytest.raises(IndexUnavailable):
                await index.lookup([1, 2, 3])  # still cooling down: skipped at once
            await table.refresh()  # through the same client: not dropped on a timeout
            assert table.get("r0")["running"] == 30
            _sent(decider, _route([1, 2, 3], "a"), "r0")  # r0 holds the prefix, but is swamped
            routed = decider.degraded(_route([1, 2, 3, 4], "b"), ["r0", "r1"], lambda rid: 0)
            assert routed.decision.replica_id == "r1" and routed.decision.reason == "stale"
        finally:
            await table.close()
            await index.close()

    asyncio.run(scenario())


def test_a_new_replica_is_read_before_its_first_decision(redis_server):
    """A replacement appears among the candidates: the first decision that sees it reads its
    heartbeat at once (one shared read for a burst), so a burst of cold requests is spread by
    load instead of avoiding it as unknown until the next background refresh (60 s here)."""
    import uuid

    import redis

    from router.protocol.redis_schema import LOAD_FIELDS, Heartbeat, RedisKeys

    prefix = f"new-{uuid.uuid4().hex[:6]}"
    keys = RedisKeys(prefix)
    sync = redis.Redis.from_url(redis_server.url)
    for rid, load in (("old", {"running": 6, "waiting": 2, "pending_prefill_tokens": 900}), ("new", {})):
        sync.hset(keys.heartbeat(rid), mapping={f: load.get(f, getattr(Heartbeat(), f)) for f in LOAD_FIELDS})

    async def scenario():
        index = RedisIndex(RedisConfig(redis_server.url, prefix))
        table = LoadTable(index, refresh_s=60.0, seed=0)
        decider = Decider(make_policy("affinity", seed=0), table, InflightPrefixes(3.0, keep_s=30.0))
        try:
            table.watch(["old"])
            await table.refresh()
            assert table.get("new") is None  # never read: unknown, priced as the busiest
            seen = []

            async def decision_time():  # each of a burst waits for the one shared read
                await table.include(["old", "new"])
                seen.append(table.get("new"))

            await asyncio.gather(*(decision_time() for _ in range(8)))
            assert seen == [{f: getattr(Heartbeat(), f) for f in LOAD_FIELDS}] * 8  # the defaults it wrote
            first = table._catch_up
            look = await index.lookup([11, 12, 13])
            routed = decider.score(_route([11, 12, 13], None), ["old", "new"], look, lambda rid: 0)
            assert routed.decision.replica_id == "new" and routed.decision.reason == "load", routed
            await table.include(["old", "new"])  # unchanged candidates: no new read
            assert table._catch_up is first
        finally:
            await table.close()
            await index.close()

    asyncio.run(scenario())
