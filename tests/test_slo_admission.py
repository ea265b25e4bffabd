"""Admission by latency objectives (issue 52, third slice): the gateway's queue orders a tenant's
requests by deadline (arrival + x-slo-ttft-ms) within its fair turns, a queue without objectives
is ordered exactly as before (against a copy of the old discipline), and a default or flex
request that cannot meet its TTFT objective on any replica is shed with a 429 and Retry-After
(predicted as it is about to be sent, or its deadline passed in the queue) while a priority one
is served; `slo_shed` set as a user sets it; then one live app of sim replicas.

Pure tests run on given times and fake clocks; the asyncio ones and the live one wait on events
(futures, the gateway's /metrics) with hang guards only: no wall-clock thresholds."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import random
import uuid
from collections import deque
from dataclasses import dataclass, field

import httpx
import pytest
from prometheus_client import REGISTRY

from gateway.errors import APIError
from gateway.flow.admission import FlowController, Ticket
from gateway.flow.fair_queue import Entry, FairQueue
from gateway.flow.saturation import Capacity
from gateway.flow.slo_admission import RETRY_AFTER_MAX_S, Shed, TtftFloor, predicted_shed, refusal
from router.latency_model import MIN_SAMPLES, LatencyModels
from router.protocol.redis_schema import queued_ahead, queued_by_priority
from tests.helpers.slo import ask, metric_sum, samples
from tests.helpers.stack import wait_until

PRIORITY, DEFAULT, FLEX = 0, 1, 2


def drain(q: FairQueue) -> list:
    out = []
    while len(q):
        out.append(q.pop().payload)
    return out


# ---- the queue: deadline order within a tenant's fair turns ---------------------------------------
def test_a_tenants_requests_leave_by_deadline_those_without_one_after_in_arrival_order():
    q = FairQueue(100)
    for name, due in (("none0", math.inf), ("late", 5.0), ("early", 2.0), ("none1", math.inf), ("mid", 3.0)):
        q.push(Entry(DEFAULT, "a", 10, payload=name, due=due))
    assert drain(q) == ["early", "mid", "late", "none0", "none1"]


def test_deadlines_never_change_which_tenant_is_served_when():
    """Random queues of three tenants (weights 1, 2, 3, random costs): with random deadlines on
    some requests, the sequence of tenants served is the one without deadlines, and each tenant's
    requests leave in order of deadline, then arrival."""
    weights = {"a": 1.0, "b": 2.0, "c": 3.0}
    for seed in range(50):
        rng = random.Random(seed)
        pushes = [(rng.choice("abc"), rng.randint(1, 500), rng.choice([math.inf, rng.uniform(0, 10)]))
                  for _ in range(rng.randint(1, 60))]
        plain, timed = FairQueue(1000, weights.get), FairQueue(1000, weights.get)
        for i, (flow, cost, due) in enumerate(pushes):
            plain.push(Entry(DEFAULT, flow, cost, payload=(flow, i)))
            timed.push(Entry(DEFAULT, flow, cost, payload=(flow, i), due=due))
        served = drain(timed)
        assert [f for f, _ in served] == [f for f, _ in drain(plain)], seed
        for flow in weights:
            mine = [i for f, i in served if f == flow]
            assert mine == sorted(mine, key=lambda i: (pushes[i][2], i)), (seed, flow)


def test_a_flood_with_tight_deadlines_still_waits_its_turn():
    q = FairQueue(100)
    for i in range(5):
        q.push(Entry(DEFAULT, "flood", 100, payload=f"flood{i}", due=0.001 * i))
    q.push(Entry(DEFAULT, "quiet", 100, payload="quiet"))  # no objective, arrived last
    assert drain(q).index("quiet") == 1  # as without deadlines: the quiet tenant's first turn


def test_overdue_requests_of_the_sheddable_bands_are_taken_out():
    q = FairQueue(100)
    q.push(Entry(PRIORITY, "a", 10, payload="prio-late", due=1.0))
    q.push(Entry(DEFAULT, "a", 10, payload="late", due=1.0))
    q.push(Entry(DEFAULT, "a", 10, payload="none"))
    q.push(Entry(FLEX, "b", 10, payload="flex-late", due=2.0))
    q.push(Entry(FLEX, "b", 10, payload="flex-in-time", due=9.0))
    assert sorted(e.payload for e in q.overdue(5.0, (DEFAULT, FLEX))) == ["flex-late", "late"]
    assert drain(q) == ["prio-late", "none", "flex-in-time"]  # priority is never taken out


# ---- a queue without objectives is today's ---------------------------------------------------------
@dataclass(eq=False)
class _OldEntry:
    rank: int
    flow: str
    cost: float
    deadline: float
    payload: object
    seq: int = 0
    start: float = 0.0
    finish: float = 0.0
    queued: bool = False


@dataclass
class _OldBand:
    vtime: float = 0.0
    flows: dict = field(default_factory=dict)
    last_finish: dict = field(default_factory=dict)
    size: int = 0


class _TodaysQueue:
    """gateway/flow/fair_queue.py as it was before deadlines (1ac69fc), its logic verbatim."""

    def __init__(self, capacity, weight):
        self.capacity, self.weight, self._bands, self._seq = capacity, weight, [_OldBand() for _ in range(3)], itertools.count()

    def __len__(self):
        return sum(b.size for b in self._bands)

    def entries(self):
        return [e for b in self._bands for q in b.flows.values() for e in q]

    def push(self, e):
        band = self._bands[e.rank]
        e.seq = next(self._seq)
        e.start = max(band.vtime, band.last_finish.get(e.flow, band.vtime))
        e.finish = e.start + e.cost / max(self.weight(e.flow), 1e-9)
        band.last_finish[e.flow] = e.finish
        band.flows.setdefault(e.flow, deque()).append(e)
        band.size += 1
        e.queued = True
        if len(self) <= self.capacity:
            return None
        band = next(b for b in reversed(self._bands) if b.size)
        flow = max(band.flows, key=lambda f: (band.last_finish[f] - band.vtime, band.flows[f][-1].seq))
        victim = band.flows[flow][-1]
        self.remove(victim)
        return victim

    def pop(self):
        for band in self._bands:
            if band.size:
                e = min((q[0] for q in band.flows.values()), key=lambda x: (x.finish, x.seq))
                band.vtime = max(band.vtime, e.start)
                self._take(band, e)
                return e
        return None

    def remove(self, e):
        if not e.queued:
            return False
        band = self._bands[e.rank]
        if band.flows[e.flow][-1] is e:
            band.last_finish[e.flow] = e.start
        self._take(band, e)
        return True

    def expired(self, now):
        late = [e for e in self.entries() if e.deadline <= now]
        for e in late:
            self.remove(e)
        return late

    def _take(self, band, e):
        q = band.flows[e.flow]
        q.remove(e)
        if not q:
            del band.flows[e.flow]
        band.size -= 1
        e.queued = False
        if not band.size:
            band.vtime = 0.0
            band.last_finish.clear()


def test_a_queue_without_objectives_behaves_exactly_as_today():
    """Random pushes (three bands, four tenants of different weights, random costs and maximum
    waits, a small capacity so the full queue sheds), pops, removals and expiries on a fake
    clock: every answer of the queue equals the old discipline's."""
    weights = {"a": 1.0, "b": 2.0, "c": 0.5, None: 1.0}
    for seed in range(200):
        rng = random.Random(seed)
        new, old = FairQueue(8, weights.get), _TodaysQueue(8, weights.get)
        mine: dict[int, tuple[Entry, _OldEntry]] = {}
        now = 0.0
        for step in range(150):
            now += rng.uniform(0, 0.5)
            op = rng.random()
            if op < 0.5:
                rank, flow, cost, wait = rng.randrange(3), rng.choice(["a", "b", "c", None]), rng.randint(1, 400), rng.uniform(1, 20)
                pair = Entry(rank, flow, cost, now + wait, payload=step), _OldEntry(rank, flow, cost, now + wait, step)
                mine[step] = pair
                v_new, v_old = new.push(pair[0]), old.push(pair[1])
                assert (v_new and v_new.payload) == (v_old and v_old.payload), (seed, step)
            elif op < 0.8:
                got, want = new.pop(), old.pop()
                assert (got and got.payload) == (want and want.payload), (seed, step)
            elif op < 0.9 and mine:
                key = rng.choice(list(mine))
                assert new.remove(mine[key][0]) == old.remove(mine[key][1]), (seed, step)
            else:
                assert sorted(e.payload for e in new.expired(now)) == sorted(e.payload for e in old.expired(now))
            assert len(new) == len(old) and new.depths() == {
                (r, f): len(q) for r, b in enumerate(old._bands) for f, q in b.flows.items()}, (seed, step)
        assert [e.payload for e in iter(new.pop, None)] == [e.payload for e in iter(old.pop, None)]


# ---- the shed decision -------------------------------------------------------------------------------
def test_flex_and_default_are_shed_when_the_prediction_misses():
    for tier in ("default", "flex"):
        shed = predicted_shed(tier, 100, waited_s=0.02, predicted_s=0.5)
        assert shed == Shed("predicted", 100, 0.02, 0.5) and shed.retry_after_s == 1  # 0.4 s over: 1 s
    assert predicted_shed("default", 100, waited_s=0.06, predicted_s=0.05) is not None  # the wait counts
    assert predicted_shed("default", 100, waited_s=0.0, predicted_s=0.1) is None  # exactly on it: met
    assert predicted_shed("default", 1000, waited_s=0.0, predicted_s=4.2).retry_after_s == 4  # 3.2 s of work to drain
    assert predicted_shed("flex", 1, waited_s=0.0, predicted_s=1e6).retry_after_s == RETRY_AFTER_MAX_S


def test_priority_is_never_shed_and_no_prediction_admits():
    assert predicted_shed("priority", 1, waited_s=10.0, predicted_s=100.0) is None
    assert predicted_shed("default", 1, waited_s=10.0, predicted_s=None) is None  # cold, stale, Redis away
    assert predicted_shed("default", None, waited_s=10.0, predicted_s=100.0) is None  # no TTFT objective


def test_the_refusal_says_why_in_openais_shape():
    e = refusal(Shed("predicted", 150, 0.01, 2.5), "default")
    body = e.body()["error"]
    assert e.status == 429 and e.headers == {"Retry-After": "3"} and body["code"] == "slo_unattainable"
    assert body["type"] == "rate_limit_error" and "150 ms" in body["message"] and "2500 ms" in body["message"]
    late = refusal(Shed("expired", 150, 0.2), "flex", retry_after_s=7)
    assert late.headers == {"Retry-After": "7"} and "waited 200 ms" in late.body()["error"]["message"]


def _heartbeat(totals: list[int], **load: int | str) -> dict[str, int | str]:
    names = ("step_count", "step_us", "step_prefill_tokens", "step_rows", "step_context_tokens", "step_started")
    return {**dict(zip(names, totals, strict=True)), "step_token_budget": 512, **load}


def test_the_ttft_floor_is_cold_until_every_replica_is_warm_and_stale_without_reads():
    """Heartbeats of two replicas whose steps take 10 ms + 0.1 ms per row, read once a (fake)
    second: no floor while either is cold; then the least p90 over both, the busier one's higher;
    none once the reads stop."""
    clock = [0.0]
    floor = TtftFloor(models=LatencyModels(refit_s=0.0), clock=lambda: clock[0])
    rng = random.Random(3)
    totals = {"idle": [0] * 6, "busy": [0] * 6}
    for read in range(MIN_SAMPLES + 2):
        for rid, t in totals.items():
            steps, rows = rng.randint(2, 8), rng.randint(1, 30)
            us = steps * (10_000 + 100 * rows + rng.randint(0, 500))
            totals[rid] = [t[0] + steps, t[1] + us, t[2], t[3] + steps * rows, t[4] + steps * rows * 100, t[5]]
        loads = {"idle": _heartbeat(totals["idle"]),
                 "busy": _heartbeat(totals["busy"], running=40, waiting=6, pending_prefill_tokens=5000)}
        if read < MIN_SAMPLES:  # the first read is no sample: MIN_SAMPLES reads are one short
            floor.observe(loads, clock[0])
            assert floor.best_ttft_s() is None, read
        else:
            floor.observe({"idle": loads["idle"]} if read == MIN_SAMPLES else loads, clock[0])
        clock[0] += 1.0
    best = floor.best_ttft_s()
    busy_only = TtftFloor(models=floor.models, clock=lambda: clock[0])
    busy_only.observe({"busy": loads["busy"]}, clock[0])
    assert best is not None and 0.01 <= best < busy_only.best_ttft_s()
    floor.observe({**loads, "new": _heartbeat([5, 50_000, 0, 5, 0, 0])}, clock[0])
    assert floor.best_ttft_s() is None  # a new (cold) replica might meet anything
    floor.observe(loads, clock[0])
    clock[0] += floor.max_age_s + 1
    assert floor.best_ttft_s() is None  # no read for max_age_s: stale


def test_the_floor_of_a_priority_counts_only_the_work_it_waits_for():
    """A replica whose queue is a flood's (priority 1: default tier, crowded): a request of priority
    0 (default, within its share) waits for none of it there, so its floor is the busy replica's
    step alone; priority 1 and a replica that gives no breakdown wait for all of it."""
    clock = [0.0]
    floor = TtftFloor(models=LatencyModels(refit_s=0.0), clock=lambda: clock[0])
    rng = random.Random(4)
    t = [0] * 6
    for _ in range(MIN_SAMPLES + 2):
        steps, prefill = rng.randint(2, 8), rng.randint(0, 400)
        t = [t[0] + steps, t[1] + steps * (10_000 + 200 * prefill), t[2] + steps * prefill, t[3] + steps * 4, t[4], t[5]]
        floor.observe({"r": _heartbeat(t, running=4, waiting=20, pending_prefill_tokens=30_000,
                                       queued_by_priority=queued_by_priority({1: (20, 30_000)}))}, clock[0])
        clock[0] += 1.0
    quiet, crowded = floor.best_ttft_s(0), floor.best_ttft_s(1)
    assert quiet is not None and crowded is not None
    assert quiet < 0.1 < 5.0 < crowded  # one step of 10 ms, against 30,000 tokens at 0.2 ms
    assert floor.best_ttft_s(None) == crowded  # behind all the work


def test_queued_ahead_reads_the_breakdown_or_falls_back_to_the_totals():
    text = queued_by_priority({1: (3, 900), -1: (1, 50), 0: (2, 200)})
    assert text == "-1:1:50 0:2:200 1:3:900"
    load = {"waiting": 6, "pending_prefill_tokens": 1150 + 64, "queued_by_priority": text}  # 64: a pull's tokens
    assert queued_ahead(load, -2) == (0, 64)  # the pull's tokens are ahead of everyone
    assert queued_ahead(load, 0) == (3, 314) and queued_ahead(load, 5) == (6, 1214)
    assert queued_ahead({"waiting": 6, "pending_prefill_tokens": 1150, "queued_by_priority": ""}, 0) == (6, 1150)
    # two requests waiting on hand-overs (or pulls): in `waiting`, not in the engine's breakdown, ahead of everyone
    handing = {**load, "waiting": 8, "handovers_in_flight": 2}
    assert queued_ahead(handing, -2) == (2, 64) and queued_ahead(handing, 0) == (5, 314)
    with pytest.raises(ValueError):
        queued_ahead({"queued_by_priority": "0:x"}, 0)


# ---- the admission controller ------------------------------------------------------------------------
def _slo_shed(reason: str, tier: str = "default", tenant: str = "a") -> float:
    labels = {"model_name": "m-slo", "tenant": tenant, "tier": tier, "reason": reason}
    return REGISTRY.get_sample_value("prefixgate_slo_shed_total", labels) or 0.0


class _Forecast:
    """A fake TTFT floor: counts how often admission asks."""

    def __init__(self, value: float | None) -> None:
        self.value, self.asked = value, 0
        self.priorities: list[int] = []  # the scheduling priority each ask was for

    def __call__(self, priority: int) -> float | None:
        self.asked += 1
        self.priorities.append(priority)
        return self.value


def _controller(forecast, seats: int = 4, **kw) -> FlowController:
    waits = {"priority": 60.0, "default": 60.0, "flex": 60.0}
    return FlowController(Capacity(seats, 10_000, 2, 0.0), 10, waits, replicas=1, model="m-slo", tenants=("a",),
                          forecast=forecast, **kw)


def test_a_request_that_cannot_meet_its_objective_is_shed_or_sent_as_its_tier_allows():
    async def run():
        forecast = _Forecast(0.5)  # 500 ms at best: a 100 ms objective cannot be met
        flow = _controller(forecast)
        before = _slo_shed("predicted"), _slo_shed("predicted", "flex")
        for tier in ("default", "flex"):
            with pytest.raises(APIError) as e:
                await flow.acquire(Ticket(tier, "a", 10, 1, 10, ttft_ms=100))
            assert e.value.status == 429 and e.value.headers["Retry-After"] == "1" and e.value.code == "slo_unattainable"
        assert (_slo_shed("predicted"), _slo_shed("predicted", "flex")) == (before[0] + 1, before[1] + 1)
        prio = Ticket("priority", "a", 10, 1, 10, ttft_ms=100)
        await flow.acquire(prio)  # never shed for its objective
        met, plain = Ticket("default", "a", 10, 1, 10, ttft_ms=5000), Ticket("default", "a", 10, 1, 10)
        await flow.acquire(met)
        await flow.acquire(plain)
        assert prio.sent and met.sent and plain.sent and flow.ledger.in_flight == 3
        assert forecast.asked == 3  # once per request with an objective in a sheddable tier
        # asked for the priority each would run at on the replica (tiers.replica_priority): default
        # and flex within the tenant's share, then default again once the tenant holds a seat
        # (its priority request in flight: its share, so crowded)
        assert forecast.priorities == [0, 2, 1]
        cold = _controller(_Forecast(None))
        await cold.acquire(Ticket("default", "a", 10, 1, 10, ttft_ms=1))  # no prediction: admitted as today
        off = _controller(_Forecast(0.5), slo_shed=False)
        await off.acquire(Ticket("default", "a", 10, 1, 10, ttft_ms=1))  # the setting off: never shed
        assert off.forecast.asked == 0

    asyncio.run(run())


def test_a_queued_request_is_asked_once_as_it_leaves_the_queue():
    async def run():
        forecast = _Forecast(0.5)
        flow = _controller(forecast, seats=1)
        await flow.acquire(Ticket("default", "a", 10, 1, 10))
        doomed = asyncio.create_task(flow.acquire(Ticket("default", "a", 10, 1, 10, ttft_ms=60_000)))
        plain = asyncio.create_task(flow.acquire(Ticket("default", "a", 10, 1, 10)))
        while flow.depth() < 2:
            await asyncio.sleep(0)
        assert forecast.asked == 0  # queued: nothing asked yet
        forecast.value = 61.0  # the replicas got slow while it waited
        flow.finished(1)  # a seat frees: the head is asked, shed, and the next one sent
        with pytest.raises(APIError) as e:
            await doomed
        assert e.value.status == 429 and "61000 ms" in e.value.message
        await plain
        assert forecast.asked == 1

    asyncio.run(run())


def test_a_queued_request_past_its_deadline_is_shed_unless_priority():
    async def run():
        flow = _controller(_Forecast(None), seats=1)
        await flow.acquire(Ticket("default", "a", 10, 1, 10))
        before = _slo_shed("expired", "flex")
        late = asyncio.create_task(flow.acquire(Ticket("flex", "a", 10, 1, 10, ttft_ms=1)))
        prio = Ticket("priority", "a", 10, 1, 10, ttft_ms=1)
        waiting = asyncio.create_task(flow.acquire(prio))
        with pytest.raises(APIError) as e:
            await late  # the queue's tick sheds it once its deadline passed
        assert e.value.status == 429 and int(e.value.headers["Retry-After"]) >= 1 and "waited" in e.value.message
        assert _slo_shed("expired", "flex") == before + 1 and not waiting.done()
        flow.finished(1)
        await waiting  # the priority one waited on and was sent
        assert prio.sent

    asyncio.run(run())


def test_deadline_order_through_the_controller():
    async def run():
        flow = _controller(None, seats=1)
        await flow.acquire(Ticket("default", "a", 10, 1, 10))
        order: list[str] = []

        async def wait(name: str, ticket: Ticket) -> None:
            await flow.acquire(ticket)
            order.append(name)

        now = asyncio.get_running_loop().time()  # arrivals given: the deadlines do not depend on timing
        tickets = {"plain": Ticket("default", "a", 10, 1, 10, arrival=now),
                   "relaxed": Ticket("default", "a", 10, 1, 10, arrival=now, ttft_ms=50_000),
                   "tight": Ticket("default", "a", 10, 1, 10, arrival=now, ttft_ms=20_000)}
        tasks = [asyncio.create_task(wait(name, t)) for name, t in tickets.items()]
        while flow.depth() < 3:
            await asyncio.sleep(0)
        for done in range(1, 4):
            flow.finished(1)
            while len(order) < done:
                await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(run()) == ["tight", "relaxed", "plain"]


# ---- the setting, as a user sets it ---------------------------------------------------------------
def test_slo_shed_from_the_command_line_and_a_serve_config(tmp_path):
    import yaml

    from gateway.cli import _serve_args, config_from_args
    from gateway.config import AppConfig
    from gateway.flow.keys import parse_keys
    from gateway.served_model import ServedModel

    p = argparse.ArgumentParser()
    _serve_args(p)
    assert config_from_args(p.parse_args([])).slo_shed is True
    assert config_from_args(p.parse_args(["--slo-shed", "false"])).slo_shed is False
    with pytest.raises(SystemExit):
        p.parse_args(["--slo-shed", "sometimes"])
    serve_yaml = tmp_path / "serve.yaml"
    serve_yaml.write_text(yaml.safe_dump({"applications": [{"name": "prefixgate", "import_path": "gateway.app:app_builder",
                                                            "args": {"engine": "sim", "slo_shed": False}}]}))
    config = AppConfig.from_dict(yaml.safe_load(serve_yaml.read_text())["applications"][0]["args"])
    assert config.slo_shed is False
    for shed in (True, False):  # it reaches the model's queue, with the heartbeats' TTFT floor
        cfg = AppConfig(engine="sim", redis_url="redis://127.0.0.1:1", slo_shed=shed).model_configs()[0]
        flow = ServedModel(cfg, None, parse_keys({}), lambda: False, 1).flow
        assert flow.slo_shed is shed and flow.forecast is not None and flow.reader.on_read is not None
    no_redis = ServedModel(AppConfig(engine="sim", redis_url=None).model_configs()[0], None, parse_keys({}),
                           lambda: False, 1).flow
    assert no_redis.forecast is None  # no heartbeats: no prediction, admitted as today


# ---- a live app of sim replicas --------------------------------------------------------------------
APP = "slo-admission"
SIM_SERVICE = {"prefill_overhead_s": 0.05, "decode_step_s": 0.01}


@pytest.fixture(scope="module")
def slo_admission_app(stack):
    from gateway.config import AppConfig
    from tests.helpers.stack import side_app

    args = {"redis_url": stack.config.redis_url, "key_prefix": f"sloa-{uuid.uuid4().hex[:6]}", "engine": "sim",
            "replicas": 1, "num_blocks": 256, "block_size": 16, "max_model_len": 4096, "redis_timeout_s": 1.0,
            "sim_service": SIM_SERVICE}
    with side_app(stack, APP, AppConfig.from_dict(args)) as url:
        yield url, httpx.get(f"{url}/metrics", timeout=30).text


def test_an_objective_no_replica_can_meet_is_shed_on_default_and_served_on_priority_live(slo_admission_app):
    """Once the gateway's step model of the replica is warm (it learns from requests without
    objectives), a default request with x-slo-ttft-ms: 1 gets a 429 with Retry-After and the
    shed counter rises; the same request on the priority tier is served."""

    url, before = slo_admission_app
    zeros = {(lb["tier"], lb["reason"]) for lb, v in samples(before, "prefixgate_slo_shed_total") if v == 0}
    assert zeros == {(t, r) for t in ("default", "flex") for r in ("predicted", "expired")}, zeros
    headers = {"x-slo-ttft-ms": "1"}

    def shed() -> httpx.Response | None:
        warm = ask(url, "none", max_tokens=16)  # work for the step model to learn from, without objectives
        assert warm.status_code == 200, warm.text
        answer = ask(url, "none", headers, max_tokens=4)
        assert answer.status_code in (200, 429), answer.text  # 200 while the model is cold
        return answer if answer.status_code == 429 else None

    refused = wait_until("a request shed for its objective", shed, timeout_s=300)
    error = refused.json()["error"]
    assert int(refused.headers["Retry-After"]) >= 1 and error["code"] == "slo_unattainable", refused.text
    assert error["type"] == "rate_limit_error" and "objective of 1 ms" in error["message"], error
    text = httpx.get(f"{url}/metrics", timeout=30).text
    assert metric_sum(text, "prefixgate_slo_shed_total", tier="default", reason="predicted") >= 1
    assert metric_sum(text, "prefixgate_shed_requests_total", reason="slo") >= 1
    assert metric_sum(text, "prefixgate_slo_requests_total", tier="default") >= 1  # judged: missed

    served = ask(url, "none", headers, max_tokens=4, service_tier="priority")
    assert served.status_code == 200 and served.json()["service_tier"] == "priority", served.text
    text = httpx.get(f"{url}/metrics", timeout=30).text
    assert metric_sum(text, "prefixgate_slo_shed_total", tier="priority") == 0
