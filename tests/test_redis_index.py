"""The shared index against a real redis-server and a real 3-master Redis Cluster: publish,
lookup, eviction, death and fleet-wide garbage collection, resync."""

from __future__ import annotations

import asyncio
import math
import uuid

import pytest
import redis

from router.index.redis_index import IndexUnavailable, RedisConfig, RedisIndex
from router.load_table import LoadTable
from router.protocol.hashing import block_hashes
from router.protocol.media import DEVICE
from router.protocol.redis_schema import RedisKeys
from tests.helpers.index import BS, FakeReplica, _matched, eventually, sync_client


@pytest.fixture
def prefix():
    return f"t{uuid.uuid4().hex[:8]}"


def test_publish_lookup_evict_and_isolation(redis_url, prefix):
    async def scenario():
        a = FakeReplica(redis_url, prefix, "ra", num_blocks=6)
        b = FakeReplica(redis_url, prefix, "rb")
        a.publisher.start()
        b.publisher.start()
        index = RedisIndex(RedisConfig(redis_url, prefix, timeout_s=0.5))
        other = RedisIndex(RedisConfig(redis_url, prefix + "x", timeout_s=0.5))
        try:
            sys_prompt = list(range(100, 112))  # 3 blocks
            hashes = a.run(sys_prompt + [1, 2, 3, 4, 5])  # 4 full blocks cached on ra
            b.run(sys_prompt[:4] + [9] * 8)  # only the first block in common

            async def matched():
                look = await index.lookup(hashes, ["ra", "rb", "rc"], None)
                return look if look.replicas["ra"].matched_blocks == 4 and look.replicas["rb"].matched_blocks == 1 else None

            look = await eventually(matched)
            assert look.replicas["rc"].matched_blocks == 0
            assert set((await index.lookup(hashes)).replicas) == {"ra", "rb"}  # only holders come back
            loads = LoadTable(index)
            loads.watch(["ra", "rb", "rc"])
            await loads.refresh()
            assert loads.get("ra")["capacity_blocks"] == 6 and loads.get("rb")["capacity_blocks"] == 16
            assert loads.get("rc") is None  # no heartbeat: unknown, not idle
            await loads.close()
            # another key prefix sees nothing of this deployment
            assert (await other.lookup(hashes, ["ra", "rb"], None)).replicas["ra"].matched_blocks == 0

            a.run([7] * 24)  # needs all 6 blocks: evicts everything ra held before

            async def evicted():
                look = await index.lookup(hashes, ["ra"], None)
                return look.replicas["ra"].matched_blocks == 0

            await eventually(evicted)
            await index.remember_session("s1", "rb")
            assert (await index.lookup(hashes, ["ra", "rb"], "s1")).session_replica == "rb"
        finally:
            await a.publisher.stop()
            await b.publisher.stop()
            await index.close()
            await other.close()

    asyncio.run(scenario())


def test_depth_limits_what_is_published(redis_url, prefix):
    async def scenario():
        a = FakeReplica(redis_url, prefix, "ra", depth=2)
        a.publisher.start()
        index = RedisIndex(RedisConfig(redis_url, prefix, timeout_s=0.5))
        try:
            hashes = a.run(list(range(20)))
            await eventually(lambda: _matched(index, hashes, "ra", 2))
            await asyncio.sleep(0.2)
            client = sync_client(redis_url)
            assert client.scard(RedisKeys(prefix).blocks("ra")) == 2
        finally:
            await a.publisher.stop()
            await index.close()

    asyncio.run(scenario())


def test_dead_replica_stops_counting_and_is_collected(redis_url, prefix):
    """A crashed replica's entries go once its heartbeat expires, removed by exactly one of
    the live replicas (the holder of the fleet's garbage-collection lease)."""
    keys = RedisKeys(prefix)

    async def scenario():
        dead = FakeReplica(redis_url, prefix, "dead")  # the default TTL: a stall here must not expire it early
        live = [FakeReplica(redis_url, prefix, f"live{i}") for i in range(3)]
        for r in (dead, *live):
            r.publisher.start()
        index = RedisIndex(RedisConfig(redis_url, prefix, timeout_s=0.5))
        client = sync_client(redis_url)
        try:
            hashes = dead.run(list(range(16)))
            await eventually(lambda: _matched(index, hashes, "dead", 4))
            await dead.publisher.stop(unregister=False)  # a crash: nothing cleaned up by the replica
            client.pexpire(keys.heartbeat("dead"), 1)  # its heartbeat's TTL runs out now
            # one GC period (0.2 s) on a quiet machine; the deadline only bounds the wait on a busy one
            await eventually(lambda: _matched(index, hashes, "dead", 0), timeout=15)
            await eventually(_async(lambda: not client.exists(keys.blocks("dead"))), timeout=5)
            await eventually(_async(lambda: b"dead" not in client.smembers(keys.replicas)), timeout=5)
            assert not any(client.sismember(keys.block(h), "dead") for h in hashes)
            await eventually(_async(lambda: sum(r.publisher.stats.collected for r in live) >= 1))
            await asyncio.sleep(0.5)  # a few more collection periods: nobody counts it twice
            assert sum(r.publisher.stats.collected for r in live) == 1
        finally:
            for r in live:
                await r.publisher.stop()
            await index.close()

    asyncio.run(scenario())


def _async(fn):
    async def check():
        return fn()

    return check


def test_restart_clears_earlier_incarnation(redis_url, prefix):
    keys = RedisKeys(prefix)
    client = sync_client(redis_url)
    client.sadd(keys.blocks("ra"), 111, 222)  # left by an earlier process with the same id
    client.sadd(keys.block(111), "ra")

    async def scenario():
        a = FakeReplica(redis_url, prefix, "ra")
        a.publisher.start()
        try:
            hashes = a.run(list(range(8)))
            await eventually(_async(lambda: client.smembers(keys.blocks("ra")) == {str(h).encode() for h in hashes}))
            # shards apply a pipeline's parts in parallel: wait for the inverted index too
            await eventually(_async(lambda: not client.sismember(keys.block(111), "ra")))
            await eventually(_async(lambda: all(client.sismember(keys.block(h), "ra") for h in hashes)))
        finally:
            await a.publisher.stop()
        assert not client.exists(keys.blocks("ra"))  # a clean stop retracts everything
        assert not any(client.exists(keys.block(h)) for h in hashes)

    asyncio.run(scenario())


@pytest.mark.redis  # a redis-server of its own, restarted
def test_resync_after_redis_restart_and_fast_failure_while_down(prefix):
    from gateway.local_redis import LocalRedis

    server = LocalRedis().start()
    try:
        async def scenario():
            a = FakeReplica(server.url, prefix, "ra")
            a.publisher.start()
            index = RedisIndex(RedisConfig(server.url, prefix, timeout_s=0.05, cooldown_s=0.2))
            try:
                hashes = a.run(list(range(12)))
                await eventually(lambda: _matched(index, hashes, "ra", 3))
                server.stop()
                with pytest.raises(IndexUnavailable):  # an error, not a request blocked on a dead Redis
                    await asyncio.wait_for(index.lookup(hashes, ["ra"], None), timeout=30)
                more = a.run(list(range(100, 108)))  # events while Redis is away
                await asyncio.sleep(0.3)
                server.start()
                await eventually(lambda: _matched(index, hashes, "ra", 3), timeout=10)
                await eventually(lambda: _matched(index, more, "ra", 2), timeout=10)
                try:
                    await eventually(_async(lambda: a.publisher.stats.resyncs >= 2), timeout=10)
                except AssertionError:
                    raise AssertionError(f"no resync after the restart: {a.publisher.stats}") from None
                assert a.publisher.stats.errors >= 1
            finally:
                await a.publisher.stop()
                await index.close()

        asyncio.run(scenario())
    finally:
        server.cleanup()


def test_routers_share_what_they_just_sent(redis_url, prefix):
    """Router A sends a prompt nobody has computed yet to rx: router B's next lookup already
    counts rx as holding it (before any replica publishes a block), until the short TTL ends."""
    from router.index.index_writer import IndexWriter

    async def scenario():
        a = RedisIndex(RedisConfig(redis_url, prefix, timeout_s=2.0))  # no fallback on a busy machine
        b = RedisIndex(RedisConfig(redis_url, prefix, timeout_s=2.0))
        try:
            hashes = block_hashes(list(range(40)), BS, 0)  # 10 blocks
            await IndexWriter(await a._open_guarded(), a.keys).apply("ra", [("+", hashes[:3], DEVICE)])
            await b.lookup(hashes)  # router B connected (a first connection can take a while)
            await a.mark_inflight(hashes[3:], "rx", ttl_ms=5000)  # outlives a stall before the next lookup
            look = await b.lookup(hashes)
            assert {rid: e.matched_blocks for rid, e in look.replicas.items()} == {"ra": 3, "rx": 10}
            await eventually(lambda: _matched(b, hashes, "rx", 0), timeout=10)  # the TTL ended
            assert (await b.lookup(hashes, ["ra"])).replicas["ra"].matched_blocks == 3
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())


def test_cleared_during_a_resync_is_not_lost(redis_url, prefix):
    """The engine drops its cache (cleared()) after a resync took its snapshot but before the
    resync finished: the stale snapshot must not stay in Redis (resync generations)."""
    keys = RedisKeys(prefix)
    client = sync_client(redis_url)

    async def scenario():
        a = FakeReplica(redis_url, prefix, "ra")
        hashes = a.run(list(range(12)))  # cached before the publisher starts: in the first snapshot
        original = a._snapshot
        taken = []

        def snapshot():
            result = original()
            if not taken:
                taken.append(True)
                a.bm.clear_cache()  # calls publisher.cleared() while this resync is under way
            return result

        a.publisher._snapshot = snapshot
        a.publisher.start()
        try:
            await eventually(_async(lambda: a.publisher.stats.resyncs >= 2))
            await eventually(_async(lambda: not client.exists(keys.blocks("ra"))))
            assert not any(client.exists(keys.block(h)) for h in hashes)
        finally:
            await a.publisher.stop()

    asyncio.run(scenario())


def test_a_connection_dying_under_a_call_is_an_index_failure_not_a_crash(redis_url, prefix):
    """uvloop reports a call on a closed transport as RuntimeError: it must become
    IndexUnavailable (the router degrades) and drop the client, never escape into Ray's loop."""

    async def main():
        index = RedisIndex(RedisConfig(redis_url, prefix, timeout_s=0.5, cooldown_s=0.0))
        client = await index._open_guarded()

        async def closed_transport():
            raise RuntimeError("unable to perform operation on <TCPTransport closed=True>")

        with pytest.raises(IndexUnavailable):
            await index._guard(closed_transport())
        assert index.failures == 1
        assert index._client is None  # reconnects on the next call
        await index.lookup(block_hashes(list(range(64)), BS, 0))  # and it does
        assert index._client is not None and index._client is not client
        await index.close()

    asyncio.run(main())


def test_one_late_reply_costs_one_lookup_and_late_replies_in_a_row_trip_the_cool_down(redis_server, prefix):
    """A single timed-out lookup (a GC pause, a CPU-starved gateway) loses only that decision's
    index; `timeouts_to_trip` timeouts in a row mean Redis is really slow: skip it for the
    cool-down instead of making every request pay the timeout."""

    async def main():
        # healthy lookups get 1 s (a busy machine is not a slow Redis); the paused ones 50 ms, and
        # the pauses are long enough that every paused lookup is sent while they last
        config = RedisConfig(redis_server.url, prefix, timeout_s=1.0, cooldown_s=30.0, timeouts_to_trip=3)
        index = RedisIndex(config)
        sync = redis.Redis.from_url(redis_server.url)
        hashes = block_hashes(list(range(64)), BS, 0)
        try:
            await index.lookup(hashes)  # connected, script loaded
            config.timeout_s = 0.05
            sync.client_pause(2000)  # every other client's commands wait 2 s from now
            with pytest.raises(IndexUnavailable):
                await index.lookup(hashes)
            await asyncio.to_thread(sync.ping)  # answered once the pause is over
            config.timeout_s = 1.0
            await index.lookup(hashes)  # one late reply did not trip the cool-down
            config.timeout_s = 0.05
            sync.client_pause(4000)
            for _ in range(3):
                with pytest.raises(IndexUnavailable, match="Timeout"):
                    await index.lookup(hashes)
            await asyncio.to_thread(sync.ping)
            with pytest.raises(IndexUnavailable, match="cooling down"):
                await index.lookup(hashes)  # Redis answers again, but the breaker is open
            assert index.failures == 4
        finally:
            sync.close()
            await index.close()

    asyncio.run(main())


def test_stop_ends_the_loop_when_a_call_turns_the_cancel_into_an_error(redis_url, prefix):
    """Python 3.11's wait_for can swallow a cancel, and a dead engine answers the snapshot with
    an error: either way stop() (and asyncio.run's final cancel) must end the loop, not leave it
    retrying every second forever."""
    from replica.serve.publisher import BlockPublisher, PublisherConfig

    snapshots = []

    async def snapshot():
        snapshots.append(1)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise RuntimeError("engine is shut down") from None  # the cancel comes back as an error
        return []

    async def scenario():
        publisher = BlockPublisher(PublisherConfig(redis_url, "rstop", prefix), snapshot=snapshot, load=dict)
        publisher.start()
        while not snapshots:  # bounded by the wait_for below
            await asyncio.sleep(0.01)
        await publisher.stop()
        assert publisher._task.done() and not publisher._task.cancelled()
        assert publisher.stats.errors == 0  # the loop saw the stop, not a Redis failure to retry
        return len(snapshots)

    assert asyncio.run(asyncio.wait_for(scenario(), timeout=60)) == 1


def test_a_request_arriving_or_finishing_is_in_the_heartbeat_before_the_period_ends(redis_url, prefix):
    """Routers price a replica from its heartbeat: with a 60 s period, the load a request left
    behind would be read for a minute. `load_changed` has the next flush write it."""
    from replica.serve.publisher import BlockPublisher, PublisherConfig

    load = {"running": 1, "waiting": 0}

    async def snapshot():
        return []

    def polled(cond):
        async def check():
            return cond()
        return check

    async def scenario():
        config = PublisherConfig(redis_url, "rbeat", prefix, heartbeat_s=60.0, heartbeat_ttl_s=120.0)
        publisher = BlockPublisher(config, snapshot=snapshot, load=lambda: dict(load))
        client = sync_client(redis_url)
        key = RedisKeys(prefix).heartbeat("rbeat")
        publisher.start()
        try:
            await eventually(polled(lambda: publisher.beats and not publisher.resync_due), 30)  # registered, resynced
            assert client.hget(key, "running") == b"1"
            beats = publisher.beats
            load["running"] = 0  # the request finished
            publisher.load_changed()
            await eventually(polled(lambda: publisher.beats > beats), 30)
            assert client.hget(key, "running") == b"0"
            # without a change nothing more is written within the period: enough loop passes
            # (each pauses flush_s) for the change throttle to have let another write through
            rounds, passes = publisher.rounds, math.ceil(config.beat_on_change_s / config.flush_s) + 2
            await eventually(polled(lambda: publisher.rounds >= rounds + passes), 30)
            assert publisher.beats == beats + 1
        finally:
            await publisher.stop()

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))
