"""Whether a model's replicas have room for one more request.

Two views, both needed:

* This gateway's own account (`Ledger`), exact and current: requests it sent and that have
  not finished (`in_flight`), and the prompt tokens of those that have not produced their
  first token yet (`unstarted_tokens`: prefill work queued or running on a replica; the
  budget is `prefill_tokens` per replica, and one unstarted request per replica always fits). It
  changes the moment a request starts or ends, so a freed seat is refilled at once.
* The replicas' heartbeats (the load the router's table reads: waiting requests, pending
  prefill tokens, free K/V), which also count what other gateways sent. They are a few
  hundred milliseconds old, so they only close the gate: when every replica is full (short
  of K/V; with several gateways, also queued up), and only for tenants at or over their share
  (one within it is served ahead of them in the replicas: has_room).

A gateway with nothing in flight always sends its head request (stale heartbeats or other
gateways must never leave its queue waiting for nothing).

With several gateways, each also writes its tenants' seats in flight into Redis and reads the
others' (`HeartbeatReader`, the same round trip as the heartbeats; `Elsewhere`), so whether a
tenant holds its share of the seats (`Ledger.over_share`: the replicas' order and the
headroom seats) is judged over the fleet: a flood through one gateway is over its share at
the replicas even when a quiet tenant's requests come through another.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from router.protocol.redis_schema import LOAD_FIELDS, FlowSeats, RedisKeys, parse_heartbeat

log = logging.getLogger("prefixgate.flow")


@dataclass(frozen=True)
class Capacity:
    max_in_flight: int  # this gateway: requests sent to replicas and not finished
    prefill_tokens: int  # per replica: prompt tokens sent and not started (and a replica's pending prefill)
    max_waiting: int  # per replica: requests in a replica's own queue at which it is full
    kv_free_min: float  # per replica: below this fraction of free K/V blocks it is full
    shared: bool = False  # other gateways send to these replicas too: their queues count
    headroom: int = 0  # seats past max_in_flight for tenants within their share (a fair-share floor: Ledger.over_share)
    # with several gateways, the replicas' seats and headroom for all of them together (0: no
    # such bound): each gateway's own share is rounded up, so K gateways could otherwise send
    # up to K-1 more than the replicas take (1 replica, 2 gateways: a headroom seat each)
    fleet_max_in_flight: int = 0
    fleet_headroom: int = 0


HEADROOM_PER_REPLICA = 1  # seats a replica takes past max_ongoing_requests (gateway/app.py): a tenant within its share never waits for a flood's


@dataclass(frozen=True)
class Elsewhere:
    """The other gateways' seats to the same replicas (their FlowSeats, summed), as last read."""

    in_flight: int = 0
    seats: dict[str | None, int] = field(default_factory=dict)  # tenant (None: anonymous) -> seats in flight


NOWHERE = Elsewhere()


@dataclass
class Ledger:
    in_flight: int = 0
    unstarted_tokens: int = 0
    unstarted: int = 0  # requests sent whose first token has not come
    by_flow: dict = field(default_factory=dict)  # tenant -> [seats in flight, requests unstarted]

    def flow(self, flow) -> tuple[int, int]:
        """(seats in flight, requests not started) of one tenant."""
        seats, unstarted = self.by_flow.get(flow, (0, 0))
        return seats, unstarted

    def over_share(self, flow, weight: Callable[[object], float] | None = None, elsewhere: Elsewhere = NOWHERE) -> bool:
        """Whether `flow` holds at least its weighted share of the seats in flight (this
        gateway's and, `elsewhere`, the other gateways'), the seats divided among the tenants
        holding any (`weight`: a tenant's weight, 1 when None). Not "holds any seat": a tenant's
        last request stays open for a moment after its client read the end of it (the gateway
        closes it on a later turn of its loop), and the client's next request then looked like a
        flood's."""
        seats = self.flow(flow)[0] + elsewhere.seats.get(flow, 0)
        if not seats:
            return False
        w = weight or (lambda _flow: 1.0)
        holders = {f for f, (held, _) in self.by_flow.items() if held > 0}
        holders.update(f for f, held in elsewhere.seats.items() if held > 0)
        total = sum(w(f) for f in holders)
        return seats >= (self.in_flight + elsewhere.in_flight) * w(flow) / max(total, 1e-9)

    def seats(self) -> FlowSeats:
        """What this gateway writes for the others (a tenant is a string; anonymous requests,
        one flow, in a field of their own)."""
        return FlowSeats(t=time.time(), in_flight=self.in_flight, anonymous=self.flow(None)[0],
                         seats={f: held for f, (held, _) in self.by_flow.items() if held > 0 and f is not None})

    def add(self, flow, seats: int, unstarted: int) -> None:
        mine = self.by_flow.setdefault(flow, [0, 0])
        mine[0] += seats
        mine[1] += unstarted
        if mine == [0, 0]:
            del self.by_flow[flow]


def replica_full(load: dict[str, int], cap: Capacity) -> bool:
    """A replica short of K/V; or, when other gateways send to it too (`shared`), one with
    `max_waiting` requests in its own queue, or one queued behind at least a budget of pending
    prefill (a single long prompt alone does not fill it). A lone gateway's own ledger already
    holds what it sends to the replica's queues, exactly and without the heartbeats' lag.

    K/V a new request can take is the free blocks and the cached ones no request holds (evicted
    on demand): a warm replica's pool is full of cached prefixes, and is not short of K/V."""
    total = load.get("capacity_blocks", 0)
    available = min(load.get("free_blocks", 0) + load.get("cached_blocks", 0), total)
    if total and available / total < cap.kv_free_min:
        return True
    if not cap.shared:
        return False
    waiting = load.get("waiting", 0)
    if waiting >= cap.max_waiting:
        return True
    return bool(waiting) and load.get("pending_prefill_tokens", 0) >= cap.prefill_tokens


def fleet_saturated(loads: list[dict[str, int]] | None, cap: Capacity) -> bool:
    """Every replica with a heartbeat is full (none known: not saturated, as far as we know)."""
    return bool(loads) and all(replica_full(load, cap) for load in loads)


STALE_SEATS_S = 60.0  # a gateway's FlowSeats not rewritten for this long is deleted by the others (it is gone)
_SEATS_ENCODER = msgspec.json.Encoder()
_SEATS_DECODER = msgspec.json.Decoder(FlowSeats)

PIPELINE = 2  # unstarted requests per replica that always go: one computing, one ready behind it


def has_room(ledger: Ledger, n: int, tokens: int, loads: list[dict[str, int]] | None, cap: Capacity,
             replicas: int, flow=None, weight: Callable[[object], float] | None = None,
             elsewhere: Elsewhere = NOWHERE) -> bool:
    """Whether a request of tenant `flow`, `n` streams and `tokens` prompt tokens may be sent now."""
    if ledger.in_flight == 0:
        return True
    _, unstarted = ledger.flow(flow)
    within = not ledger.over_share(flow, weight, elsewhere)
    if ledger.in_flight + n > cap.max_in_flight + (cap.headroom if within else 0):
        return False  # a tenant within its share may use the headroom: it never waits for a flood's seats
    fleet = ledger.in_flight + elsewhere.in_flight + n  # the others' as last read (a refresh old)
    if cap.fleet_max_in_flight and fleet > cap.fleet_max_in_flight + (cap.fleet_headroom if within else 0):
        return False
    live = max(len(loads) if loads else replicas, 1)
    # pending prefill: within the budget, or fewer than PIPELINE unstarted requests per replica (a
    # prompt longer than a replica's budget still goes, and the next is there when it starts, so
    # a lone tenant never leaves a replica idle), or the tenant's first: a tenant with nothing
    # pending never waits for another's prompts to start (and goes ahead of them in the
    # replica's queue: flow/tiers.py replica_priority)
    if unstarted and ledger.unstarted >= PIPELINE * live and ledger.unstarted_tokens + tokens > cap.prefill_tokens * live:
        return False
    # full replicas hold back the tenants at or over their share; a tenant within it goes (in its
    # headroom), since it is served ahead of them in the replicas' queues (tiers.replica_priority:
    # tenants only, anonymous requests are one flow there): held here, it waited for a heartbeat
    # to show room that the flood's next request takes at once
    return (within and flow is not None) or not fleet_saturated(loads, cap)


class HeartbeatReader:
    """The heartbeats of this deployment's replicas, re-read every `refresh_s` (the replica ids
    from the registry set every `ids_every` refreshes). `loads()` is None when they are unknown:
    Redis away, or nothing read for `max_age_s`. With `share` (several gateways) each refresh
    also writes this gateway's FlowSeats under `gateway_id` and reads the others'
    (`elsewhere()`: nothing known once they are older than `max_age_s`). `on_read`, when set,
    is given each read's heartbeats by replica id and its time (the model's TTFT floor:
    slo_admission.TtftFloor)."""

    def __init__(self, redis_url: str, keys: RedisKeys, refresh_s: float = 0.1, timeout_s: float = 0.5,
                 max_age_s: float = 3.0, ids_every: int = 10, share: Callable[[], FlowSeats] | None = None,
                 gateway_id: str = "") -> None:
        self.redis_url, self.keys = redis_url, keys
        self.refresh_s, self.timeout_s, self.max_age_s, self.ids_every = refresh_s, timeout_s, max_age_s, ids_every
        self.share, self.gateway_id = share, gateway_id
        self.on_read: Callable[[dict[str, dict[str, int]], float], None] | None = None
        self._loads: list[dict[str, int]] = []
        self._elsewhere = NOWHERE
        self._ids: list[str] = []
        self._client = None
        self._task: asyncio.Task | None = None
        self._closed = False
        self.updated_at = 0.0
        self.reads = 0

    def loads(self) -> list[dict[str, int]] | None:
        if time.monotonic() - self.updated_at > self.max_age_s:
            return None
        return self._loads

    def elsewhere(self) -> Elsewhere:
        """The other gateways' seats as last read (nothing, once the read is `max_age_s` old)."""
        if time.monotonic() - self.updated_at > self.max_age_s:
            return NOWHERE
        return self._elsewhere

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def refresh(self) -> None:
        from router.index.redis_index import open_client

        if self._client is None:
            self._client = await asyncio.wait_for(open_client(self.redis_url, self.timeout_s), self.timeout_s * 2)
        if self.reads % self.ids_every == 0 or not self._ids:
            self._ids = sorted(await asyncio.wait_for(self._client.smembers(self.keys.replicas), self.timeout_s))
        pipe = self._client.pipeline(transaction=False)
        for rid in self._ids:
            pipe.hmget(self.keys.heartbeat(rid), *LOAD_FIELDS)
        sharing = self.share is not None and not self._closed  # closed: close() deletes the entry, nothing rewrites it
        if sharing:
            pipe.hset(self.keys.flow_seats, self.gateway_id, _SEATS_ENCODER.encode(self.share()))
            pipe.expire(self.keys.flow_seats, int(STALE_SEATS_S))  # a fleet gone uncleanly leaves no hash behind
            pipe.hgetall(self.keys.flow_seats)
        answers = await asyncio.wait_for(pipe.execute(), self.timeout_s) if len(pipe) else []
        if sharing:
            self._elsewhere = await self._others(answers[-1])
        answers = answers[: len(self._ids)]
        by_id = {rid: load for rid, values in zip(self._ids, answers, strict=True)
                 if (load := parse_heartbeat(values)) is not None}
        self._loads = list(by_id.values())
        self.reads += 1
        self.updated_at = time.monotonic()
        if self.on_read is not None:
            try:  # its failure must not cost flow control its heartbeats (nor the connection)
                self.on_read(by_id, self.updated_at)
            except Exception:
                log.exception("heartbeat consumer failed")

    async def _others(self, entries: dict) -> Elsewhere:
        """The other gateways' FlowSeats summed; entries older than `max_age_s` count for
        nothing, and those older than STALE_SEATS_S (a gateway gone) are deleted."""
        now, in_flight, seats, gone = time.time(), 0, {}, []
        for field_, raw in entries.items():
            gateway = field_.decode() if isinstance(field_, bytes) else field_
            if gateway == self.gateway_id:
                continue
            try:
                entry = _SEATS_DECODER.decode(raw)
            except msgspec.DecodeError:
                gone.append(gateway)
                continue
            if now - entry.t > STALE_SEATS_S:
                gone.append(gateway)
            if now - entry.t > self.max_age_s:
                continue
            in_flight += entry.in_flight
            for tenant, held in [*entry.seats.items(), (None, entry.anonymous)]:
                if held:
                    seats[tenant] = seats.get(tenant, 0) + held
        if gone:  # best effort: a failed clean-up must not cost this refresh its heartbeats
            try:
                await asyncio.wait_for(self._client.hdel(self.keys.flow_seats, *gone), self.timeout_s)
            except Exception as e:
                log.debug("flow-seats clean-up failed: %r", e)
        return Elsewhere(in_flight, seats)

    async def _run(self) -> None:
        while not self._closed:  # a cancel that Python 3.11's wait_for swallowed still ends it here
            try:
                await self.refresh()
                delay = self.refresh_s
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis away: loads() goes None after max_age_s; try again later
                if asyncio.current_task().cancelling():  # a cancel that Python 3.11's wait_for swallowed
                    return
                log.debug("heartbeat read failed: %r", e)
                await self._drop()
                delay = 1.0
            await asyncio.sleep(delay)

    async def _drop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await asyncio.wait_for(client.aclose(), 0.5)
            except Exception:
                pass

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=1.0)
        if self.share is not None and self._client is not None:
            try:  # the others stop counting this gateway's seats at once, not after max_age_s
                await asyncio.wait_for(self._client.hdel(self.keys.flow_seats, self.gateway_id), self.timeout_s)
            except Exception:
                pass
        await self._drop()
