"""The gateway's admission: requests wait here, in the fair queue, while the model's replicas are
saturated, and leave in the queue's order as room frees (gateway/flow/saturation.py).

`acquire` returns once the request may be sent (its seats are then taken in the ledger), or
raises the APIError to answer: 429 when the queue is full and this request is the one refused,
or when it waited its tier's maximum; 503 while the gateway shuts down. A waiter whose client
went away is cancelled by Serve: its request leaves the queue and is never sent. Seats are
given back through `done` + `set_in_flight` (a request ends) and `started` (first token: its
prompt is no longer pending prefill); each of those sends whatever now fits.

Latency objectives (gateway/flow/slo_admission.py): a queued request with a TTFT objective
leaves before its tenant's later-due ones (fair_queue.py); with `slo_shed`, a `default` or
`flex` request that the gateway's prediction says cannot meet its objective anywhere, asked once
as it is about to be sent, is refused with a 429, and so is one whose objective's deadline
passes while it waits. A `priority` request waits as any other.

Only a request's first admission passes here: a stream that moves to another replica after a
replica failure (gateway/migration.py) continues inside its ResilientStream and never queues
again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway import metrics as m
from gateway.errors import APIError
from gateway.flow.fair_queue import Entry, FairQueue, Flow
from gateway.flow.saturation import NOWHERE, Capacity, Elsewhere, HeartbeatReader, Ledger, has_room
from gateway.flow.slo_admission import SHEDDABLE_RANKS, Shed, predicted_shed, refusal
from gateway.flow.tiers import RANK, TIERS, replica_priority

log = logging.getLogger("prefixgate.flow")
TICK_S = 0.05  # while requests wait: expiry and heartbeat changes are looked at this often
IDLE_S = 1.0  # otherwise: gauges re-set this often (Ray drops a gauge value not refreshed)
DRAIN_WINDOW_S = 30.0  # the queue's drain rate is measured over the sends of this long
RETRY_AFTER_MAX_S = 60  # the longest Retry-After a queue refusal names


def retry_after_s(ahead: int, sends: list[float], now: float) -> int:
    """Whole seconds until a request sent now would likely leave the queue: the `ahead` requests
    it would queue behind, at the rate the queue sent requests over the last DRAIN_WINDOW_S
    (`sends`: their monotonic times, oldest first; a queue that stopped sending drains slower the
    longer it has been stopped). 1 at least, RETRY_AFTER_MAX_S at most; 1 with nothing queued
    ahead or too few recent sends to measure a rate."""
    recent = [t for t in sends if now - t <= DRAIN_WINDOW_S]
    if ahead <= 0 or len(recent) < 2 or recent[-1] <= recent[0]:
        return 1
    rate = (len(recent) - 1) / max(now - recent[0], recent[-1] - recent[0])
    return max(1, min(RETRY_AFTER_MAX_S, math.ceil(ahead / rate)))


@dataclass(eq=False)
class Ticket:
    tier: str
    flow: Flow
    cost: int  # WFQ cost: prompt tokens + n x max_tokens
    n: int  # seats: streams the request runs
    tokens: int  # prompt tokens (pending prefill until its first token)
    arrival: float = field(default_factory=time.monotonic)
    ttft_ms: int | None = None  # its TTFT objective (None: none): its deadline in the queue, its shed
    sent: bool = False
    asked: bool = False  # the TTFT prediction was read for it (once per request)
    crowded: bool = False  # sent while its tenant held its share of the seats or more (Ledger.over_share, tiers.replica_priority)
    started_: bool = False
    done_: bool = False


class FlowController:
    def __init__(self, capacity: Capacity, queue_size: int, max_wait_s: dict[str, float], replicas: int,
                 weight: Callable[[Flow], float] | None = None, reader: HeartbeatReader | None = None,
                 label: Callable[[Flow], str] | None = None, tenants: tuple[str, ...] = (),
                 shutting_down: Callable[[], bool] | None = None, enabled: bool = True, model: str = "",
                 forecast: Callable[[int], float | None] | None = None, slo_shed: bool = True) -> None:
        self.capacity, self.max_wait_s, self.replicas = capacity, dict(max_wait_s), replicas
        self.queue = FairQueue(queue_size, weight)
        self.ledger = Ledger()
        self.reader = reader
        self.label = label or (lambda flow: "anonymous" if flow is None else flow)
        self.tenant_labels = tuple(dict.fromkeys(tenants or ("anonymous",)))
        self.shutting_down = shutting_down  # polled (off the loop) while requests wait
        self.enabled = enabled  # False: the old admission (no queue: seats up to the bound, then 429)
        self.closed = False
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self.sent = 0
        self._sends: deque[float] = deque(maxlen=256)  # recent send times: the drain rate for Retry-After
        self.model = model  # the served model whose queue this is (its metrics' model_name)
        # the best p90 TTFT on the replicas, seconds (slo_admission.TtftFloor; None: no prediction)
        self.forecast = forecast
        self.slo_shed = slo_shed  # shed default and flex requests that cannot meet their TTFT objective

    # ---- the request's side ------------------------------------------------------------------
    async def acquire(self, ticket: Ticket) -> None:
        if self.closed:
            raise self._refusal("shutdown", ticket)
        self._ensure_task()
        if not len(self.queue) and self._room(ticket):
            shed = self._predicted(ticket)
            if shed is not None:
                raise self._slo_refusal(shed, ticket)
            self._send(ticket)
            return
        if not self.enabled:
            raise self._refusal("queue_full", ticket)
        fut = asyncio.get_running_loop().create_future()
        due = ticket.arrival + ticket.ttft_ms / 1000 if ticket.ttft_ms is not None else math.inf
        entry = Entry(RANK[ticket.tier], ticket.flow, ticket.cost, ticket.arrival + self.max_wait_s[ticket.tier],
                      payload=(ticket, fut), due=due)
        victim = self.queue.push(entry)
        if victim is not None:
            self._refuse(victim, "queue_full")
        self._pump()
        self._wake.set()
        try:
            await fut
        except asyncio.CancelledError:  # its client went away (Serve cancels the handler)
            self.queue.remove(entry)
            if ticket.sent:  # sent just as its client left: give the seats back, it never starts
                self.started(ticket)
                self.done(ticket)
                self.finished(ticket.n)
            else:
                self._count("disconnected", ticket)
            raise

    def started(self, ticket: Ticket) -> None:
        """The request's first token came (or it failed before): its prompt is no longer pending."""
        if ticket.sent and not ticket.started_:
            ticket.started_ = True
            self.ledger.unstarted_tokens -= ticket.tokens
            self.ledger.unstarted -= 1
            self.ledger.add(ticket.flow, 0, -1)
            self._pump()

    def done(self, ticket: Ticket) -> None:
        """The request ended: its tenant's seats are free (the total goes down through
        `set_in_flight`, which the request's RequestRun.close drives)."""
        if ticket.sent and not ticket.done_:
            ticket.done_ = True
            self.ledger.add(ticket.flow, -ticket.n, 0)

    def finished(self, n: int) -> None:
        self.set_in_flight(self.ledger.in_flight - n)

    def set_in_flight(self, value: int) -> None:
        """The gateway's `in_flight` (a request ends: RequestRun.close lowers it)."""
        freed = value < self.ledger.in_flight
        self.ledger.in_flight = value
        if freed:
            self._pump()

    # ---- the queue's side --------------------------------------------------------------------
    def _room(self, ticket: Ticket) -> bool:
        if not self.enabled:
            return self.ledger.in_flight + ticket.n <= self.capacity.max_in_flight
        loads = self.reader.loads() if self.reader is not None else None
        return has_room(self.ledger, ticket.n, ticket.tokens, loads, self.capacity, self.replicas, ticket.flow,
                        self.queue.weight, self._elsewhere())

    def _elsewhere(self) -> Elsewhere:
        """The other gateways' tenants in flight (nothing known with one gateway, or Redis away)."""
        return self.reader.elsewhere() if self.reader is not None else NOWHERE

    def _send(self, ticket: Ticket) -> None:
        ticket.sent = True
        # anonymous requests are one flow: FIFO in the replica
        ticket.crowded = ticket.flow is not None and self.ledger.over_share(ticket.flow, self.queue.weight, self._elsewhere())
        self.ledger.in_flight += ticket.n
        self.ledger.unstarted_tokens += ticket.tokens
        self.ledger.unstarted += 1
        self.ledger.add(ticket.flow, ticket.n, 1)
        self.sent += 1
        now = time.monotonic()
        self._sends.append(now)
        m.QUEUE_WAIT.labels(self.model, ticket.tier, self._label(ticket.flow)).observe(now - ticket.arrival)

    def _pump(self) -> None:
        """Send queued requests, best first, while there is room (never past the head: a big
        request is not overtaken for ever by smaller ones behind it)."""
        now = time.monotonic()
        for entry in self.queue.expired(now):
            self._refuse(entry, "max_wait")
        if self.slo_shed:  # past its objective's deadline: it cannot meet it any more
            for entry in self.queue.overdue(now, SHEDDABLE_RANKS):
                ticket, _ = entry.payload
                self._reject(entry, self._slo_refusal(Shed("expired", ticket.ttft_ms, now - ticket.arrival), ticket))
        while (entry := self.queue.peek()) is not None:
            ticket, fut = entry.payload
            if fut.done():  # cancelled: its waiter takes it out as it wakes
                self.queue.remove(entry)
                continue
            if not self._room(ticket):
                break
            self.queue.pop()
            shed = self._predicted(ticket)
            if shed is not None:
                self._reject(entry, self._slo_refusal(shed, ticket))
                continue
            self._send(ticket)
            fut.set_result(None)

    def _predicted(self, ticket: Ticket) -> Shed | None:
        """Whether `ticket`, about to be sent, is shed for its TTFT objective: the prediction is
        read once per request, and only for a sheddable one with an objective."""
        if not self.slo_shed or ticket.asked or ticket.ttft_ms is None or ticket.tier == "priority":
            return None
        ticket.asked = True
        # it waits on the replica for the work of its own priority and better only
        crowded = ticket.flow is not None and self.ledger.over_share(ticket.flow, self.queue.weight, self._elsewhere())
        predicted = self.forecast(replica_priority(ticket.tier, crowded)) if self.forecast is not None else None
        return predicted_shed(ticket.tier, ticket.ttft_ms, time.monotonic() - ticket.arrival, predicted)

    def _slo_refusal(self, shed: Shed, ticket: Ticket) -> APIError:
        m.SLO_SHED.labels(self.model, self._label(ticket.flow), ticket.tier, shed.reason).inc()
        m.SHED.labels(self.model, "slo", self._label(ticket.flow)).inc()
        retry = self.retry_after(ticket.tier) if shed.reason == "expired" else None
        return refusal(shed, ticket.tier, retry)

    def _reject(self, entry: Entry, error: APIError) -> None:
        """Take a queued request out with `error` (its wait observed)."""
        self.queue.remove(entry)
        ticket, fut = entry.payload
        if not fut.done():
            fut.set_exception(error)
        m.QUEUE_WAIT.labels(self.model, ticket.tier, self._label(ticket.flow)).observe(time.monotonic() - ticket.arrival)

    def _refuse(self, entry: Entry, reason: str) -> None:
        self.queue.remove(entry)
        ticket, fut = entry.payload
        if not fut.done():
            fut.set_exception(self._refusal(reason, ticket))
        if reason == "max_wait" or reason == "shutdown":
            m.QUEUE_WAIT.labels(self.model, ticket.tier, self._label(ticket.flow)).observe(time.monotonic() - ticket.arrival)

    def retry_after(self, tier: str) -> int:
        """Retry-After of a queue refusal: when a `tier` request sent now would likely leave the
        queue (those of its tier and better queued now, at the queue's recent drain rate)."""
        ahead = sum(n for (rank, _), n in self.queue.depths().items() if rank <= RANK[tier])
        return retry_after_s(ahead, list(self._sends), time.monotonic())

    def _refusal(self, reason: str, ticket: Ticket) -> APIError:
        self._count(reason, ticket)
        if reason == "shutdown":
            return APIError(503, "this gateway is shutting down; retry", "server_error", code="server_shutting_down",
                            headers={"Retry-After": "1"})
        retry = {"Retry-After": str(self.retry_after(ticket.tier))}
        if reason == "max_wait":
            waited = time.monotonic() - ticket.arrival
            return APIError(429, f"the replicas stayed saturated for {waited:.1f} s, this request's maximum wait "
                            f"in the {ticket.tier} tier; retry later", "rate_limit_error", code="server_overloaded",
                            headers=retry)
        return APIError(429, "replicas are saturated and the queue is full; retry shortly", "rate_limit_error",
                        code="server_overloaded", headers=retry)

    def _count(self, reason: str, ticket: Ticket) -> None:
        m.SHED.labels(self.model, reason, self._label(ticket.flow)).inc()
        if reason in ("queue_full", "max_wait"):
            m.REJECTED.inc()

    def _label(self, flow: Flow) -> str:
        name = self.label(flow)
        return name if name in self.tenant_labels else "other"

    # ---- background: ticks while requests wait, gauges, shutdown --------------------------
    def start(self) -> None:
        """Export the shed counters at 0 (every reason, every configured tenant), and start the
        background loop now if there is a running event loop (else: on the first request)."""
        for reason in m.SHED_REASONS:
            for tenant in self.tenant_labels:
                m.SHED.zero(self.model, reason, tenant)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._ensure_task()

    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())
            if self.reader is not None:
                self.reader.start()

    async def _run(self) -> None:
        last_gauges = 0.0
        last_poll = time.monotonic()
        while not self.closed:
            waiting = len(self.queue) > 0
            try:  # asyncio.timeout, not wait_for: a cancel racing the timeout is never swallowed
                async with asyncio.timeout(TICK_S if waiting else IDLE_S):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                self._pump()
                now = time.monotonic()
                if now - last_gauges >= IDLE_S or not len(self.queue):
                    self._gauges()
                    last_gauges = now
                if len(self.queue) and self.shutting_down is not None and now - last_poll >= 1.0:
                    last_poll = now
                    if await asyncio.to_thread(self.shutting_down):
                        log.info("the application is being deleted: refusing %d queued request(s)", len(self.queue))
                        self.close()
            except Exception:  # the loop must outlive any one failure
                log.exception("flow control tick failed")

    def _gauges(self) -> None:
        depth = {(t, lab): 0 for t in TIERS for lab in (*self.tenant_labels, "other")}
        for (rank, flow), n in self.queue.depths().items():
            depth[(TIERS[rank], self._label(flow))] += n
        for (tier, lab), n in depth.items():
            if n or lab != "other":
                m.QUEUE_DEPTH.labels(self.model, tier, lab).set(n)

    def depth(self) -> int:
        return len(self.queue)

    def close(self) -> None:
        """Refuse everything queued (503), and every later request (acquire refuses once closed)."""
        self.closed = True
        for entry in list(self.queue):
            self._refuse(entry, "shutdown")
        self._gauges()
        if self._wake is not None:
            self._wake.set()

    async def aclose(self) -> None:
        self.close()
        if self.reader is not None:
            await self.reader.close()
