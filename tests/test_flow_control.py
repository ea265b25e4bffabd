"""Flow control, pure: the queue discipline (priority bands, weighted fair queuing on tokens
between tenants, FIFO within one, work conservation, shedding, maximum waits, dropped
disconnects), the admission controller around it, saturation from heartbeats, service tiers,
the API-key file's struct, the local rate-limit buckets and their headers, and every new
setting set the way a user sets it (`prefixgate serve --flag`)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest
from prometheus_client import REGISTRY

from gateway.errors import APIError
from gateway.flow.admission import (
    DRAIN_WINDOW_S,
    RETRY_AFTER_MAX_S,
    FlowController,
    Ticket,
    retry_after_s,
)
from gateway.flow.fair_queue import Entry, FairQueue
from gateway.flow.keys import KeySpec, parse_keys
from gateway.flow.rate_limit import LocalBuckets, duration, verdict
from gateway.flow.saturation import Capacity, Ledger, fleet_saturated, has_room, replica_full
from gateway.flow.tiers import replica_priority, request_tier

PRIORITY, DEFAULT, FLEX = 0, 1, 2


def drain(q: FairQueue, n: int | None = None) -> list[Entry]:
    out = []
    while len(q) and (n is None or len(out) < n):
        out.append(q.pop())
    return out


# ---- the queue discipline ---------------------------------------------------------------------
def test_priority_first_then_fifo_within_a_tenant():
    q = FairQueue(100)
    flex = [q.push(Entry(FLEX, "a", 10, payload=f"flex{i}")) or f"flex{i}" for i in range(3)]
    default = [q.push(Entry(DEFAULT, "a", 10, payload=f"def{i}")) or f"def{i}" for i in range(3)]
    q.push(Entry(PRIORITY, "b", 1000, payload="prio"))
    order = [e.payload for e in drain(q)]
    assert order == ["prio", *default, *flex]


def test_weighted_fair_shares_of_tokens():
    weights = {"heavy": 3.0, "light": 1.0}
    q = FairQueue(10_000, weight=lambda f: weights[f])
    for _ in range(400):
        q.push(Entry(DEFAULT, "heavy", 100))
        q.push(Entry(DEFAULT, "light", 100))
    served = Counter(e.flow for e in drain(q, 200))  # both backlogged throughout
    assert served["heavy"] == 3 * served["light"]  # tokens in proportion to the weights
    # equal weights, unequal request sizes: equal tokens, not equal requests
    q = FairQueue(10_000)
    for _ in range(400):
        q.push(Entry(DEFAULT, "big", 1000))
        for _ in range(10):
            q.push(Entry(DEFAULT, "small", 100))
    tokens = Counter()
    for e in drain(q, 220):
        tokens[e.flow] += e.cost
    assert abs(tokens["big"] - tokens["small"]) <= 1000  # within one request


def test_fifo_within_a_tenant_whatever_the_sizes():
    q = FairQueue(100)
    for i, cost in enumerate([500, 5, 50, 5000, 1]):
        q.push(Entry(DEFAULT, "a", cost, payload=i))
    assert [e.payload for e in drain(q)] == [0, 1, 2, 3, 4]


def test_a_lone_tenant_gets_everything_and_nothing_waits_for_fairness():
    q = FairQueue(100, weight=lambda f: 0.01)  # a tiny weight changes nothing when alone
    for i in range(20):
        q.push(Entry(DEFAULT, "alone", 10_000, payload=i))
    popped = [q.pop() for _ in range(20)]
    assert [e.payload for e in popped] == list(range(20)) and len(q) == 0


def test_a_quiet_tenant_goes_ahead_of_a_queued_flood():
    q = FairQueue(1000)
    for _ in range(2):  # the flood's past: it has been served while queued
        q.push(Entry(DEFAULT, "flood", 2000))
    q.pop()
    for _ in range(50):
        q.push(Entry(DEFAULT, "flood", 2000))
    q.push(Entry(DEFAULT, "quiet", 2100, payload="quiet"))  # even a bigger request than the flood's
    first = drain(q, 2)
    assert "quiet" in [e.payload for e in first], [e.flow for e in first]


def test_an_idle_tenant_banks_no_credit():
    q = FairQueue(1000)
    q.push(Entry(DEFAULT, "a", 10))
    q.pop()  # the band is idle now: virtual time starts over
    for _ in range(10):
        q.push(Entry(DEFAULT, "b", 10))
    for _ in range(10):
        q.push(Entry(DEFAULT, "a", 10))
    order = [e.flow for e in drain(q)]
    assert order[:4].count("a") == 2 and order[:4].count("b") == 2  # alternate from the start


def test_full_queue_sheds_the_newest_of_the_lowest_band_most_over_share_tenant():
    q = FairQueue(6)
    for i in range(4):
        assert q.push(Entry(DEFAULT, "flood", 100, payload=f"flood{i}")) is None
    assert q.push(Entry(DEFAULT, "quiet", 100, payload="quiet0")) is None
    assert q.push(Entry(PRIORITY, "flood", 100, payload="prio0")) is None
    # full: a default request of the quiet tenant arrives; the flood is furthest over its share
    victim = q.push(Entry(DEFAULT, "quiet", 100, payload="quiet1"))
    assert victim.payload == "flood3" and not victim.queued
    # a flex request arriving at a full queue of higher bands is the one refused
    victim = q.push(Entry(FLEX, "quiet", 1, payload="flex"))
    assert victim.payload == "flex"
    # a priority arrival displaces the lowest band's request (of its most over-share tenant)
    victim = q.push(Entry(PRIORITY, "quiet", 100, payload="prio1"))
    assert victim.payload == "flood2"
    assert len(q) == 6
    assert [e.payload for e in drain(q)][:2] in (["prio0", "prio1"], ["prio1", "prio0"])


def test_shedding_a_tenants_newest_gives_its_charge_back():
    q = FairQueue(2)
    q.push(Entry(DEFAULT, "a", 100))
    q.push(Entry(DEFAULT, "a", 100, payload="shed-me"))
    before = q._bands[DEFAULT].last_finish["a"]
    victim = q.push(Entry(DEFAULT, "a", 100, payload="newest"))
    assert victim.payload == "newest"
    assert q._bands[DEFAULT].last_finish["a"] == before  # no charge for a request never served


def test_expired_requests_are_taken_out():
    q = FairQueue(10)
    keep = Entry(DEFAULT, "a", 1, deadline=100.0)
    late = Entry(FLEX, "b", 1, deadline=5.0)
    q.push(keep)
    q.push(late)
    assert q.expired(4.0) == [] and len(q) == 2
    assert q.expired(5.0) == [late] and len(q) == 1 and q.peek() is keep


def test_depths_by_band_and_tenant():
    q = FairQueue(10)
    q.push(Entry(DEFAULT, "a", 1))
    q.push(Entry(DEFAULT, "a", 1))
    q.push(Entry(FLEX, None, 1))
    assert q.depths() == {(DEFAULT, "a"): 2, (FLEX, None): 1}


# ---- saturation ---------------------------------------------------------------------------------
CAP = Capacity(max_in_flight=8, prefill_tokens=1000, max_waiting=2, kv_free_min=0.05, shared=True)


def test_replica_full_by_each_heartbeat_signal():
    idle = {"running": 1, "waiting": 0, "pending_prefill_tokens": 0, "free_blocks": 900, "capacity_blocks": 1000}
    assert not replica_full(idle, CAP)
    assert replica_full({**idle, "waiting": 2}, CAP)
    assert not replica_full({**idle, "pending_prefill_tokens": 5000}, CAP)  # one long prompt alone
    assert replica_full({**idle, "pending_prefill_tokens": 1000, "waiting": 1}, CAP)  # a request queued behind
    assert replica_full({**idle, "free_blocks": 10}, CAP)
    assert not replica_full({**idle, "free_blocks": 10, "cached_blocks": 700}, CAP)  # a warm cache: evictable
    assert not fleet_saturated([], CAP) and not fleet_saturated(None, CAP)
    assert fleet_saturated([{**idle, "waiting": 5}, {**idle, "free_blocks": 0}], CAP)
    assert not fleet_saturated([{**idle, "waiting": 5}, idle], CAP)  # one replica still has room
    alone = Capacity(8, 1000, 2, 0.05, shared=False)  # one gateway: its ledger holds the queues
    assert not replica_full({**idle, "waiting": 9}, alone) and replica_full({**idle, "free_blocks": 10}, alone)


def test_has_room_from_the_ledger_and_the_heartbeats():
    full = [{"waiting": 9}, {"waiting": 9}]
    assert has_room(Ledger(0, 0), 1, 50_000, full, CAP, 2)  # nothing in flight: always send one
    assert not has_room(Ledger(1, 0), 1, 10, full, CAP, 2)  # every replica full
    assert has_room(Ledger(1, 0), 1, 10, None, CAP, 2)  # heartbeats unknown: the ledger decides
    assert not has_room(Ledger(8, 0), 1, 10, None, CAP, 2)  # seats (no headroom)
    def ledger(in_flight: int, tokens: int, unstarted: int) -> Ledger:  # all of tenant "f"'s
        return Ledger(in_flight, tokens, unstarted, {"f": [in_flight, unstarted]})

    assert has_room(ledger(4, 1500, 4), 1, 500, None, CAP, 2, "f")  # 2 replicas x 1000 pending tokens
    assert not has_room(ledger(4, 1500, 4), 1, 501, None, CAP, 2, "f")
    assert has_room(ledger(3, 9000, 3), 1, 5000, None, CAP, 2, "f")  # two unstarted per replica always fit
    assert not has_room(ledger(4, 9000, 4), 1, 10, None, CAP, 2, "f")
    assert has_room(ledger(4, 9000, 4), 1, 10, None, CAP, 2, "quiet")  # a tenant with nothing pending goes
    # seats: a tenant with nothing in flight may use the headroom; the flood may not
    roomy = Capacity(8, 1000, 2, 0.05, headroom=2)
    assert not has_room(ledger(8, 0, 0), 1, 10, None, roomy, 2, "f")
    assert has_room(ledger(8, 0, 0), 1, 10, None, roomy, 2, "quiet")
    assert not has_room(ledger(10, 0, 0), 1, 10, None, roomy, 2, "quiet")
    # its last request still open beside the flood's seven: within its share, the headroom is its
    beside = Ledger(8, 0, 0, {"f": [7, 0], "quiet": [1, 0]})
    assert has_room(beside, 1, 10, None, roomy, 2, "quiet") and not has_room(beside, 1, 10, None, roomy, 2, "f")
    assert not has_room(beside, 1, 10, None, roomy, 2, "quiet", weight=lambda f: 10.0 if f == "f" else 0.1)



def test_full_replicas_hold_back_the_flood_not_a_tenant_within_its_share():
    """Every replica full (several gateways: queued up): the flood waits in the gateway, a quiet
    tenant within its share goes (in the headroom), since the replicas serve it ahead of the
    flood; anonymous requests are one flow and wait as before."""
    full = [{"waiting": 9, "capacity_blocks": 100, "free_blocks": 50}] * 2
    cap = Capacity(8, 1000, 2, 0.05, shared=True, headroom=2)
    flooded = Ledger(8, 0, 0, {"f": [8, 0]})
    assert not has_room(flooded, 1, 10, full, cap, 2, "f")
    assert not has_room(Ledger(4, 0, 0, {"f": [4, 0]}), 1, 10, full, cap, 2, "f")  # seats free, replicas full
    assert has_room(flooded, 1, 10, full, cap, 2, "quiet")
    assert has_room(flooded, 1, 10, None, cap, 2, "quiet")
    assert not has_room(Ledger(10, 0, 0, {"f": [8, 0], "quiet": [2, 0]}), 1, 10, full, cap, 2, "quiet")  # headroom spent
    assert not has_room(Ledger(4, 0, 0, {None: [4, 0]}), 1, 10, full, cap, 2, None)

def test_a_tenants_share_counts_the_other_gateways_seats():
    """With several gateways the share is judged over all their seats (Elsewhere: the others'
    FlowSeats read from Redis): a quiet tenant alone on its gateway, beside a flood that holds
    the seats through another, is within its share; the flood is over it on either gateway."""
    from gateway.flow.saturation import Elsewhere

    quiet_here = Ledger(1, 0, 0, {"quiet": [1, 0]})
    flood_there = Elsewhere(in_flight=7, seats={"f": 7})
    assert quiet_here.over_share("quiet")  # alone on this gateway: all of its seats are the tenant's
    assert not quiet_here.over_share("quiet", elsewhere=flood_there)
    assert quiet_here.over_share("f", elsewhere=flood_there)  # nothing of it here: over on the fleet's count
    assert not Ledger(0, 0).over_share("f", elsewhere=Elsewhere())
    # the headroom seats follow: the quiet tenant may take one past the seats, the flood may not
    roomy = Capacity(1, 1000, 2, 0.05, shared=True, headroom=1)
    assert not has_room(quiet_here, 1, 10, None, roomy, 2, "quiet")
    assert has_room(quiet_here, 1, 10, None, roomy, 2, "quiet", elsewhere=flood_there)
    assert not has_room(quiet_here, 1, 10, None, roomy, 2, "f", elsewhere=flood_there)
    # weights count fleet-wide too: a tenant of weight 9 holding 7 of 8 seats is within its share
    assert not quiet_here.over_share("f", lambda t: 9.0 if t == "f" else 1.0, flood_there)
    shared = Ledger(3, 0, 0, {"f": [2, 0], None: [1, 0]}).seats()
    assert (shared.seats, shared.anonymous, shared.in_flight) == ({"f": 2}, 1, 3)  # anonymous: one flow of its own
    # anonymous requests through the other gateways count toward their one flow's share too
    anonymous_here = Ledger(1, 0, 0, {None: [1, 0]})
    assert not anonymous_here.over_share(None, elsewhere=flood_there)
    assert anonymous_here.over_share(None, elsewhere=Elsewhere(in_flight=7, seats={None: 6, "f": 1}))

# ---- the admission controller -------------------------------------------------------------------
def _shed(reason: str, tenant: str = "b") -> float:
    """The shed counter of model "m" (the _controller's), this reason and tenant."""
    labels = {"model_name": "m", "reason": reason, "tenant": tenant}
    return REGISTRY.get_sample_value("prefixgate_shed_requests_total", labels) or 0.0


def _controller(seats: int = 1, queue: int = 10, waits: dict | None = None, **kw) -> FlowController:
    waits = waits or {"priority": 60.0, "default": 60.0, "flex": 60.0}
    kw = {"model": "m", "tenants": ("a", "b"), **kw}
    return FlowController(Capacity(seats, 10_000, 2, 0.0), queue, waits, replicas=1, **kw)


def test_admission_sends_in_order_as_seats_free():
    async def run():
        flow = _controller(seats=1)
        first = Ticket("default", "flood", 100, 1, 50)
        await flow.acquire(first)  # room: sent at once
        assert flow.ledger.in_flight == 1
        order: list[str] = []

        async def wait(name: str, ticket: Ticket):
            await flow.acquire(ticket)
            order.append(name)

        tasks = [asyncio.create_task(wait(f"flood{i}", Ticket("default", "flood", 100, 1, 50))) for i in range(3)]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(wait("quiet", Ticket("default", "quiet", 100, 1, 50))))
        tasks.append(asyncio.create_task(wait("prio", Ticket("priority", "flood", 100, 1, 50))))
        while flow.depth() < 5:
            await asyncio.sleep(0)
        assert order == []  # no seat: everyone waits
        for done in range(1, 6):
            flow.finished(1)  # a request ends: the best waiting one is sent
            while len(order) < done:
                await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        return order

    order = asyncio.run(run())
    assert order[0] == "prio"  # priority first
    assert order.index("quiet") <= 2  # then fair share: the quiet tenant ahead of most of the flood
    assert [o for o in order if o.startswith("flood")] == ["flood0", "flood1", "flood2"]  # FIFO within


def test_a_tenants_only_request_goes_first_in_the_replica_too():
    """Once sent, requests meet in the replica's queue: the priority it reads keeps the tier first,
    then puts a tenant's only request ahead of a tenant that already had others in flight."""
    async def run():
        flow = _controller(seats=8, enabled=False)  # off too: the replica's order is the same
        flood = [Ticket("default", "flood", 100, 1, 50) for _ in range(3)]
        for t in flood:
            await flow.acquire(t)
        quiet, anon, anon2 = Ticket("default", "quiet", 10, 1, 5), Ticket("default", None, 10, 1, 5), Ticket("default", None, 10, 1, 5)
        for t in (quiet, anon, anon2):
            await flow.acquire(t)
        return flood, quiet, anon, anon2

    flood, quiet, anon, anon2 = asyncio.run(run())
    assert [t.crowded for t in flood] == [False, True, True] and not quiet.crowded
    assert not anon.crowded and not anon2.crowded  # without API keys there is one flow: FIFO stays
    ranks = sorted([(replica_priority(t.tier, t.crowded), i) for i, t in enumerate([*flood, quiet])])
    assert [i for _, i in ranks] == [0, 3, 1, 2]  # flood's first, the quiet one, then the flood's others
    assert replica_priority("priority", True) < replica_priority("default", False) < replica_priority("flex", False)


def test_a_tenant_under_its_share_is_not_crowded_by_its_own_open_request():
    """A client's next request can arrive while the gateway has not yet closed its last one (it
    closes on the next turn of its loop): one open seat beside a flood's many is under the
    tenant's share, so the new request still goes ahead of the flood's in the replica."""
    async def run():
        flow = _controller(seats=16, enabled=False)
        flood = [Ticket("default", "flood", 100, 1, 50) for _ in range(6)]
        for t in flood:
            await flow.acquire(t)
        last, nxt = Ticket("default", "quiet", 10, 1, 5), Ticket("default", "quiet", 10, 1, 5)
        await flow.acquire(last)  # still open when its successor arrives
        await flow.acquire(nxt)
        more = Ticket("default", "flood", 100, 1, 50)
        await flow.acquire(more)
        return last, nxt, more

    last, nxt, more = asyncio.run(run())
    assert not last.crowded and not nxt.crowded  # 1 seat of 7 in flight, share 3.5
    assert more.crowded  # 6 of 8, share 4


def test_unstarted_prompt_tokens_hold_requests_until_started():
    async def run():
        flow = FlowController(Capacity(10, 1000, 2, 0.0), 10, {"priority": 60, "default": 60, "flex": 60}, replicas=1)
        a, b = Ticket("default", "t", 900, 1, 900), Ticket("default", "t", 900, 1, 900)
        await flow.acquire(a)
        await flow.acquire(b)  # over the budget, but a replica keeps one ready behind the one computing
        c = Ticket("default", "t", 900, 1, 900)
        waiter = asyncio.create_task(flow.acquire(c))
        while flow.depth() < 1:
            await asyncio.sleep(0)
        assert not c.sent  # 3 x 900 pending prefill tokens > 1000, two unstarted on one replica
        flow.started(a)  # a's first token: its prompt is computed
        await waiter
        assert c.sent and flow.ledger.unstarted_tokens == 1800 and flow.ledger.unstarted == 2

    asyncio.run(run())


def test_full_queue_refuses_with_429_and_retry_after():
    async def run():
        flow = _controller(seats=1, queue=1)
        await flow.acquire(Ticket("default", "a", 10, 1, 10))
        queued = asyncio.create_task(flow.acquire(Ticket("default", "a", 10, 1, 10)))
        await asyncio.sleep(0)
        before = _shed("queue_full"), _shed("queue_full", "a")  # the registry is the process's: other tests count too
        with pytest.raises(APIError) as e:  # full: the arriving flex request is the lowest band's, refused
            await flow.acquire(Ticket("flex", "b", 10, 1, 10))
        assert e.value.status == 429 and int(e.value.headers["Retry-After"]) >= 1 and e.value.code == "server_overloaded"
        assert (_shed("queue_full"), _shed("queue_full", "a")) == (before[0] + 1, before[1])  # b's, not a's
        queued.cancel()

    asyncio.run(run())


def test_retry_after_estimates_when_the_queue_reaches_the_request():
    steady = [i * 0.1 for i in range(31)]  # 10 sends a second for 3 s
    assert retry_after_s(25, steady, 3.0) == 3  # 25 ahead at 10/s
    assert retry_after_s(0, steady, 3.0) == 1  # nothing ahead
    assert retry_after_s(10_000, steady, 3.0) == RETRY_AFTER_MAX_S
    assert retry_after_s(5, [], 3.0) == 1 and retry_after_s(5, [2.0], 3.0) == 1  # no rate measured
    stalled = [i * 0.1 for i in range(11)]  # 10/s for a second, then nothing for 20 s
    assert retry_after_s(5, stalled, 21.0) == 11  # 10 sends over 21 s
    assert retry_after_s(5, stalled, 1.0 + DRAIN_WINDOW_S + 1) == 1  # all older than the window


def test_a_request_past_its_tiers_maximum_wait_gets_429():
    async def run():
        flow = _controller(seats=1, waits={"priority": 60.0, "default": 60.0, "flex": 0.01})
        await flow.acquire(Ticket("default", "a", 10, 1, 10))
        before = _shed("max_wait")
        flex = asyncio.create_task(flow.acquire(Ticket("flex", "b", 10, 1, 10)))
        default = asyncio.create_task(flow.acquire(Ticket("default", "b", 10, 1, 10)))
        with pytest.raises(APIError) as e:
            await flex  # the queue's tick refuses it once its deadline passed
        assert e.value.status == 429 and "flex tier" in e.value.message
        assert _shed("max_wait") == before + 1 and not default.done()
        flow.finished(1)
        await default  # the default one waited on and was sent

    asyncio.run(run())


def test_a_disconnected_waiter_is_dropped_and_never_sent():
    async def run():
        flow = _controller(seats=1)
        await flow.acquire(Ticket("default", "a", 10, 1, 10))
        gone = Ticket("default", "b", 10, 1, 10)
        waiter = asyncio.create_task(flow.acquire(gone))
        while flow.depth() < 1:
            await asyncio.sleep(0)
        before, sent = _shed("disconnected"), flow.sent
        waiter.cancel()  # Serve cancels the handler when its client disconnects
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert flow.depth() == 0 and _shed("disconnected") == before + 1
        flow.finished(1)
        assert flow.sent == sent and not gone.sent and flow.ledger.in_flight == 0

    asyncio.run(run())


def test_close_refuses_the_queue_with_503():
    async def run():
        flow = _controller(seats=1)
        await flow.acquire(Ticket("default", "a", 10, 1, 10))
        waiters = [asyncio.create_task(flow.acquire(Ticket("default", "a", 10, 1, 10))) for _ in range(3)]
        while flow.depth() < 3:
            await asyncio.sleep(0)
        flow.close()
        for w in waiters:
            with pytest.raises(APIError) as e:
                await w
            assert e.value.status == 503 and e.value.headers["Retry-After"]
        with pytest.raises(APIError):
            await flow.acquire(Ticket("default", "a", 10, 1, 10))

    asyncio.run(run())


def test_flow_control_off_is_the_old_bound():
    async def run():
        flow = _controller(seats=2, enabled=False)
        await flow.acquire(Ticket("default", "a", 10, 1, 10))
        await flow.acquire(Ticket("default", "a", 10, 1, 10))
        with pytest.raises(APIError) as e:
            await flow.acquire(Ticket("default", "a", 10, 1, 10))
        assert e.value.status == 429

    asyncio.run(run())


# ---- tiers ----------------------------------------------------------------------------------------
def test_service_tiers_and_vllm_priority():
    assert request_tier(None, None) == "default"
    assert request_tier("auto", None) == "default"
    assert request_tier("flex", None) == "flex" and request_tier("priority", None) == "priority"
    assert request_tier(None, -5) == "priority" and request_tier(None, 0) == "default" and request_tier(None, 3) == "flex"
    assert request_tier("flex", -5) == "flex"  # service_tier wins
    assert request_tier(None, None, "flex") == "flex"  # the key's default
    assert request_tier("priority", None, "default", "default") == "default"  # never above the key's maximum
    for bad in ("gold", "", 3, "scale"):
        with pytest.raises(APIError) as e:
            request_tier(bad, None)
        assert e.value.status == 400 and e.value.param == "service_tier" and e.value.code == "invalid_value"
        assert e.value.body()["error"]["type"] == "invalid_request_error"


# ---- the API-key file ------------------------------------------------------------------------------
def test_key_file_plain_and_object_forms():
    table = parse_keys({"sk-1": "acme", "sk-2": {"tenant": "bravo", "weight": 2, "service_tier": "flex", "rpm": 60, "tpm": 1000},
                        "sk-3": {"tenant": "bravo", "max_service_tier": "default"}})
    assert table.keys["sk-1"] == KeySpec(tenant="acme")
    assert table.keys["sk-2"].service_tier == "flex" and table.keys["sk-3"].max_service_tier == "default"
    assert table.tenants["acme"].weight == 1.0 and not table.tenants["acme"].limited
    bravo = table.tenants["bravo"]
    assert (bravo.weight, bravo.rpm, bravo.tpm) == (2.0, 60, 1000) and bravo.limited


@pytest.mark.parametrize("raw, message", [
    ({"k": 3}, "expected a tenant name or an object"),
    ({"": "t"}, "non-empty"),
    ({"k": {"tenant": ""}}, "tenant must be a non-empty"),
    ({"k": {"weight": 2}}, "tenant"),
    ({"k": {"tenant": "t", "wieght": 2}}, "unknown field"),
    ({"k": {"tenant": "t", "weight": 0}}, "weight must be a positive"),
    ({"k": {"tenant": "t", "rpm": 0}}, "rpm must be at least 1"),
    ({"k": {"tenant": "t", "tpm": 1.5}}, "tpm"),
    ({"k": {"tenant": "t", "service_tier": "gold"}}, "service_tier must be one of"),
    ({"k": {"tenant": "t", "service_tier": "priority", "max_service_tier": "flex"}}, "above max_service_tier"),
    ({"k1": {"tenant": "t", "weight": 1}, "k2": {"tenant": "t", "weight": 2}}, "same on all its keys"),
])
def test_key_file_errors_name_the_key_and_field(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_keys(raw)
    from gateway.config import AppConfig

    with pytest.raises(ValueError, match="api_keys"):  # checked where the file is loaded
        AppConfig(api_keys=raw)


def test_key_errors_never_print_the_whole_secret():
    with pytest.raises(ValueError) as e:
        parse_keys({"sk-very-secret-key-123": {"tenant": "t", "rpm": -1}})
    assert "very-secret" not in str(e.value)


# ---- local rate-limit buckets and OpenAI's headers ------------------------------------------------
def test_durations_as_openai_writes_them():
    assert [duration(ms) for ms in (0, 20, 999, 1000, 1500, 59_000, 60_000, 360_000, 3_723_000)] == \
        ["0ms", "20ms", "999ms", "1s", "1.5s", "59s", "1m0s", "6m0s", "1h2m3s"]


def test_local_buckets_and_headers():
    now = [0.0]
    buckets = LocalBuckets(clock=lambda: now[0])
    v = verdict(buckets.take("t", 2, 1000, 300), 2, 1000, 300)
    assert v.allowed and v.headers == {
        "x-ratelimit-limit-requests": "2", "x-ratelimit-remaining-requests": "1", "x-ratelimit-reset-requests": "30s",
        "x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": "700", "x-ratelimit-reset-tokens": "18s"}
    assert verdict(buckets.take("t", 2, 1000, 300), 2, 1000, 300).allowed
    v = verdict(buckets.take("t", 2, 1000, 300), 2, 1000, 300)  # no request left
    assert not v.allowed and v.refused_by == "requests" and v.retry_after_ms == 30_000
    now[0] = 30.0  # half a minute refills one request
    v = verdict(buckets.take("t", 2, 1000, 300), 2, 1000, 300)
    assert v.allowed and v.headers["x-ratelimit-remaining-requests"] == "0"
    v = verdict(buckets.take("u", 0, 1000, 5000), 0, 1000, 5000)  # more than the limit itself
    assert not v.allowed and v.refused_by == "tokens" and v.retry_after_ms == -1
    assert "x-ratelimit-limit-requests" not in v.headers  # no rpm: only the tokens headers


# ---- every new setting, as a user sets it -----------------------------------------------------------
def test_flow_settings_from_the_command_line(tmp_path):
    import argparse

    from gateway.cli import _serve_args, config_from_args

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-plain": "acme",
                                "sk-full": {"tenant": "bravo", "weight": 3, "service_tier": "flex",
                                            "max_service_tier": "default", "rpm": 120, "tpm": 50000}}))
    p = argparse.ArgumentParser()
    _serve_args(p)
    config = config_from_args(p.parse_args([
        "--api-keys", str(keys), "--flow-control", "false", "--queue-wait-priority-s", "5",
        "--queue-wait-default-s", "20", "--queue-wait-flex-s", "600", "--flow-prefill-tokens", "4096",
        "--flow-replica-waiting", "3", "--flow-kv-free-min", "0.05", "--max-queued-requests", "10"]))
    assert config.flow_control is False and config.max_queued_requests == 10
    assert (config.queue_wait_priority_s, config.queue_wait_default_s, config.queue_wait_flex_s) == (5, 20, 600)
    assert (config.flow_prefill_tokens, config.flow_replica_waiting, config.flow_kv_free_min) == (4096, 3, 0.05)
    table = parse_keys(config.api_keys)
    assert table.keys["sk-plain"].tenant == "acme" and table.tenants["bravo"].rpm == 120
    with pytest.raises(SystemExit):
        p.parse_args(["--flow-control", "maybe"])
    from gateway.config import AppConfig

    for bad in ({"queue_wait_flex_s": 0}, {"flow_prefill_tokens": 0}, {"flow_replica_waiting": 0},
                {"flow_kv_free_min": 1.0}, {"max_queued_requests": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            AppConfig(**bad)


def test_gateways_together_send_no_more_than_the_replicas_take():
    """One replica of 2 seats (and its seat more) behind two gateways: each gateway's share
    rounds up to 1 seat and 1 headroom seat, 4 in all; the fleet bound keeps the sum at 3,
    judged from the other gateway's seats as last read."""
    from gateway.flow.saturation import Elsewhere

    cap = Capacity(1, 1000, 2, 0.05, shared=True, headroom=1, fleet_max_in_flight=2, fleet_headroom=1)
    quiet_here = Ledger(1, 0, 0, {"f": [1, 0]})  # the flood holds this gateway's seat; quiet holds none
    flood_there = Elsewhere(in_flight=1, seats={"f": 1})
    assert has_room(quiet_here, 1, 10, None, cap, 1, "quiet", elsewhere=flood_there)  # 3: the replica's last seat
    assert not has_room(quiet_here, 1, 10, None, cap, 1, "f", elsewhere=flood_there)  # over its share: no headroom
    full_there = Elsewhere(in_flight=2, seats={"f": 2})  # the other gateway used its headroom too
    assert not has_room(quiet_here, 1, 10, None, cap, 1, "quiet", elsewhere=full_there)
    unbounded = Capacity(1, 1000, 2, 0.05, shared=True, headroom=1)
    assert has_room(quiet_here, 1, 10, None, unbounded, 1, "quiet", elsewhere=full_there)  # the old bound: 4 in all
    # a gateway with nothing in flight still sends (stale views must never leave its queue waiting)
    assert has_room(Ledger(0, 0), 1, 10, None, cap, 1, "quiet", elsewhere=Elsewhere(in_flight=9, seats={"f": 9}))


def test_gateways_share_the_replicas_seats():
    """K gateways each send a K-th of replicas x max_ongoing_requests (rounded up), so together
    they send what the replicas run and the excess waits in their ordered queues; off, each
    keeps the old in-flight bound."""
    from gateway.config import AppConfig
    from gateway.flow.keys import parse_keys
    from gateway.served_model import ServedModel

    def capacity(gateways: int, **kw):
        config = AppConfig(engine="sim", redis_url=None, replicas=3, max_ongoing_requests=8, gateways=gateways, **kw)
        model = ServedModel(config.model_configs()[0], None, parse_keys({}), lambda: False, gateways)
        return model.flow.capacity

    assert [capacity(k).max_in_flight for k in (1, 2, 5)] == [24, 12, 5]
    # the replicas' one seat more each (for tenants within their share) is shared the same way
    assert [capacity(k).headroom for k in (1, 2, 5)] == [3, 2, 1]
    # rounded up, the shares can add up past the replicas' seats: the sum is bounded too
    assert [(capacity(k).fleet_max_in_flight, capacity(k).fleet_headroom) for k in (1, 2, 5)] == [(0, 0), (24, 3), (24, 3)]
    assert capacity(2, flow_control=False).fleet_max_in_flight == 0
    assert capacity(2, flow_control=False).max_in_flight == 3 * 8 + 64 and capacity(2, flow_control=False).headroom == 0
