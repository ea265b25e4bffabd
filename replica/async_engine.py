"""AsyncLLMEngine: the engine's step loop on a background thread, streaming to asyncio callers.

The loop thread alone touches the engine. Callers never wait for a forward pass: new
requests, aborts and snapshots are commands put in an inbox that the thread drains between
steps, and `stats()` returns a snapshot the thread refreshes after every step and every
drained inbox. So heartbeats, health checks and aborts answer at once even while a step that
takes seconds (a long prefill) runs. Torch releases the GIL during the forward pass, so the
server's event loop keeps serving while the model runs.

Each request receives its RequestOutput deltas through an asyncio.Queue. A caller that stops
iterating (client gone, task cancelled) aborts its request and frees its blocks. If a step
raises, every in-flight request gets the error: no caller hangs.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from replica.core.engine_types import EngineStats, RequestOutput
from router.protocol.messages import GenerateRequest

if TYPE_CHECKING:  # the sim engine duck-types it; importing it at run time would load torch
    from replica.engine import LLMEngine


class EngineDeadError(RuntimeError):
    """The step loop failed or was shut down; the request did not complete."""


Command = tuple["Callable[[LLMEngine], Any]", "concurrent.futures.Future | None"]


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # held by the loop thread whenever it touches the engine; a paused loop (tests) can take it
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._inbox: collections.deque[Command] = collections.deque()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        # progress counters the loop thread writes and anyone may read (tests order events by them)
        self.steps_started = 0
        self.steps_finished = 0
        self.step_started_at: float | None = None  # monotonic start of the step running now, else None
        self._stats = engine.stats()
        self._thread = threading.Thread(target=self._loop, name="prefixgate-engine", daemon=True)
        self._thread.start()

    # ---- callers (any thread / event loop) ----------------------------------------------
    async def generate(self, request: GenerateRequest, kv_prefix: Any = None) -> AsyncIterator[RequestOutput]:
        """Yields one RequestOutput per new token; the last has finished=True.

        Invalid requests raise InvalidRequestError before anything is queued. The request goes to
        the engine as it is (`add`), with the K/V a pull brought, where there is one.
        """
        rid = request.request_id
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def add(engine: LLMEngine) -> None:
            if rid in self._streams:
                raise ValueError(f"duplicate request id {rid}")
            engine.add(request, kv_prefix)
            self._streams[rid] = (loop, queue)

        finished = False
        try:
            try:
                await self.submit(add)
            except Exception:
                finished = True  # the add failed: nothing was queued, nothing to abort
                raise
            # (cancelled while waiting: the add may still run, so the finally below aborts it)
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks, after the current step; returns at once."""

        def run(engine: LLMEngine) -> bool:
            self._streams.pop(request_id, None)
            return engine.abort(request_id)

        self._post(run, None)

    def stats(self) -> EngineStats:
        """The snapshot taken after the last step or inbox drain: never waits for the engine."""
        return self._stats

    async def submit(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the loop thread between steps and await its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._post(fn, future)
        return await asyncio.wrap_future(future)

    def post(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Run fn(engine) on the loop thread between steps without waiting for it (for callbacks
        that cannot await, e.g. releasing the pins of an export whose caller was cancelled)."""
        self._post(fn, None)

    def call(self, fn, *args):
        """Blocking form of submit for synchronous callers (tests); never call it on an event
        loop that must keep answering."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._post(lambda engine: fn(engine, *args), future)
        return future.result()

    async def hand_off(self, reason: str) -> int:
        """End every in-flight request with EngineDeadError(reason) (its caller continues it
        elsewhere) and free its blocks; returns how many there were."""

        def run(engine: LLMEngine) -> int:
            streams, self._streams = self._streams, {}
            for rid in streams:
                engine.abort(rid)
            for loop, queue in streams.values():
                _deliver(loop, queue, EngineDeadError(reason))
            return len(streams)

        return await self.submit(run)

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        self._fail_pending()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    # ---- the loop thread ---------------------------------------------------------------
    def _post(self, fn: Callable[[LLMEngine], Any], future: concurrent.futures.Future | None) -> None:
        if self._stopped:
            if future is not None:
                future.set_exception(EngineDeadError("engine is shut down"))
            return
        self._inbox.append((fn, future))
        self._wakeup.set()
        if self._stopped:  # shut down while we were appending: make sure nobody waits forever
            self._fail_pending()

    def _drain(self) -> None:
        """Run every queued command, refresh the stats snapshot, then answer the callers, so an
        answer never precedes the state it produced."""
        if not self._inbox:
            return
        results: list[tuple[concurrent.futures.Future, bool, Any]] = []
        with self._lock:
            while self._inbox:
                fn, future = self._inbox.popleft()
                if future is not None and future.cancelled():
                    continue  # its caller is gone (e.g. a timed-out snapshot): skip the work
                try:
                    value, ok = fn(self.engine), True
                except Exception as e:
                    value, ok = e, False
                if future is not None:
                    results.append((future, ok, value))
            self._stats = self.engine.stats()
        for future, ok, value in results:
            if future.set_running_or_notify_cancel():
                future.set_result(value) if ok else future.set_exception(value)

    def _loop(self) -> None:
        while not self._stopped:
            self._drain()
            if not self.engine.has_unfinished:
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            self.step_started_at = time.monotonic()
            self.steps_started += 1
            try:
                with self._lock:
                    outputs = self.engine.step()
                    deliveries = [(self._streams.get(o.request_id), o) for o in outputs]
                    for o in outputs:
                        if o.finished:
                            self._streams.pop(o.request_id, None)
                    self._stats = self.engine.stats()
            except Exception as e:  # fail every caller rather than leave them waiting
                self._fail_all(EngineDeadError(f"engine step failed: {e!r}"))
                continue
            finally:
                self.steps_finished += 1
                self.step_started_at = None
            _deliver_step(deliveries)
        self._fail_all(EngineDeadError("engine is shut down"))
        self._fail_pending()

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
            for rid in list(streams):
                self.engine.abort(rid)
            self._stats = self.engine.stats()
        for loop, queue in streams.values():
            _deliver(loop, queue, error)

    def _fail_pending(self) -> None:
        while self._inbox:
            try:
                _, future = self._inbox.popleft()
            except IndexError:
                return
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError("engine is shut down"))


def _deliver_step(deliveries: list) -> None:
    """A step's outputs to their callers: one wake-up per event loop, not one per output."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for target, out in deliveries:
        if target is not None:
            by_loop.setdefault(target[0], []).append((target[1], out))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass


def _put_all(items: list) -> None:
    for queue, out in items:
        queue.put_nowait(out)


def _deliver(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item) -> None:
    try:
        loop.call_soon_threadsafe(queue.put_nowait, item)
    except RuntimeError:  # the caller's loop is closed: nobody is listening any more
        pass
