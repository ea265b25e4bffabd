"""Tenants' seats shared between gateways through a real Redis (gateway/flow/saturation.py
HeartbeatReader with `share`): a flood through one gateway is over its share on the other, so a
quiet tenant's request there goes ahead of the flood's in the replicas; a gone gateway stops
counting."""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec
import redis

from gateway.flow.admission import FlowController, Ticket
from gateway.flow.saturation import Capacity, HeartbeatReader
from gateway.flow.tiers import replica_priority
from router.protocol.redis_schema import FlowSeats, RedisKeys

WAITS = {"priority": 60.0, "default": 60.0, "flex": 60.0}


def _gateway(url: str, keys: RedisKeys, name: str) -> FlowController:
    """One gateway's controller of the model, sharing its tenants' seats as `gateway_id` name
    (as gateway/served_model.py builds it when `gateways` > 1)."""
    # refreshed by the test only (no background loop), with deadlines and an age no loaded
    # machine reaches: what the test asserts is the arithmetic, not Redis's speed
    reader = HeartbeatReader(url, keys, timeout_s=30.0, max_age_s=600.0)
    reader.start = lambda: None
    flow = FlowController(Capacity(16, 100_000, 2, 0.0, shared=True, headroom=2), 10, WAITS, replicas=2,
                          reader=reader, tenants=("flood", "quiet"), model="m")
    reader.share, reader.gateway_id = flow.ledger.seats, name
    return flow


def test_a_flood_through_one_gateway_is_over_its_share_on_the_other(redis_server):
    keys = RedisKeys(f"test-{uuid.uuid4().hex[:6]}")

    async def run():
        a, b = _gateway(redis_server.url, keys, "gw-a"), _gateway(redis_server.url, keys, "gw-b")
        flood = [Ticket("default", "flood", 100, 1, 50) for _ in range(6)]
        for t in flood:
            await a.acquire(t)
        await a.acquire(Ticket("default", None, 10, 1, 5))  # a request without an API key
        await b.acquire(Ticket("default", "quiet", 10, 1, 5))  # its last request, still open
        alone = b.ledger.over_share("quiet")  # what b alone says: all the seats it knows are the quiet one's
        await a.reader.refresh()  # a writes its seats ...
        await b.reader.refresh()  # ... b writes its own and reads a's
        await a.reader.refresh()  # ... a reads b's
        seen_by_b = b.reader.elsewhere()
        quiet = Ticket("default", "quiet", 10, 1, 5)
        await b.acquire(quiet)
        more_flood = Ticket("default", "flood", 100, 1, 50)
        await b.acquire(more_flood)  # the flood's request through the quiet one's gateway
        await a.aclose()  # a gone gateway takes its seats out at once
        await b.reader.refresh()
        after = b.reader.elsewhere()
        await b.aclose()
        return alone, quiet, more_flood, seen_by_b, after

    alone, quiet, more_flood, seen_by_b, after = asyncio.run(run())
    assert (seen_by_b.in_flight, seen_by_b.seats) == (7, {"flood": 6, None: 1})  # anonymous: one flow of its own
    assert alone  # without the others' seats its next request would go behind the flood's in the replica
    assert not quiet.crowded and more_flood.crowded  # the quiet one's 1 of 8 fleet seats (share 8/3), the flood's 6 of 9 (share 3)
    assert replica_priority(quiet.tier, quiet.crowded) < replica_priority(more_flood.tier, more_flood.crowded)
    assert after.in_flight == 0 and after.seats == {}
    assert redis.Redis.from_url(redis_server.url).hkeys(keys.flow_seats) == []  # both gone: nothing left


def test_old_entries_count_for_nothing_and_a_gateway_gone_long_ago_is_deleted(redis_server):
    keys = RedisKeys(f"test-{uuid.uuid4().hex[:6]}")
    client = redis.Redis.from_url(redis_server.url)
    now = time.time()
    entries = {"recent": FlowSeats(t=now, in_flight=3, seats={"t": 3}),
               "late": FlowSeats(t=now - 45, in_flight=5, seats={"t": 5}),  # past max_age_s: ignored, kept
               "gone": FlowSeats(t=now - 3600, in_flight=7, seats={"t": 7})}  # past STALE_SEATS_S: deleted
    client.hset(keys.flow_seats, mapping={k: msgspec.json.encode(v) for k, v in entries.items()})
    client.hset(keys.flow_seats, "garbled", b"{not json")

    async def run():
        reader = HeartbeatReader(redis_server.url, keys, timeout_s=30.0, max_age_s=30.0, share=lambda: FlowSeats(t=time.time(), in_flight=0),
                                 gateway_id="me")
        await reader.refresh()
        seen = reader.elsewhere()
        await reader.close()
        return seen

    seen = asyncio.run(run())
    assert (seen.in_flight, seen.seats) == (3, {"t": 3})
    assert sorted(client.hkeys(keys.flow_seats)) == [b"late", b"recent"]  # "me" deleted on close, "gone" and "garbled" by the reader
    assert 0 < client.ttl(keys.flow_seats) <= 60  # each write renews it: a fleet gone uncleanly leaves no hash behind


def test_the_readers_loop_ends_on_close_even_when_a_refresh_swallows_the_cancel():
    """Python 3.11's wait_for can swallow a cancel when its inner call completes at the same
    moment; the loop then went on refreshing (rewriting this gateway's seats) after close()."""
    reader = HeartbeatReader("redis://127.0.0.1:1/0", RedisKeys("test-closed"), refresh_s=0)  # ends one loop turn after close

    async def run():
        entered = asyncio.Event()

        async def refresh_swallowing_the_first_cancel():
            if entered.is_set():
                return  # later refreshes: nothing to swallow
            entered.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                asyncio.current_task().uncancel()  # as the swallowed cancel leaves it: not cancelling

        reader.refresh = refresh_swallowing_the_first_cancel
        reader.start()
        await entered.wait()
        await reader.close()  # cancels, and waits for the loop to end
        ended = reader._task.done()
        if not ended:  # the old loop: stop it for good (its next sleep takes this cancel)
            reader._task.cancel()
            await asyncio.wait({reader._task})
        return ended

    assert asyncio.run(run())  # the loop had returned when close() did
