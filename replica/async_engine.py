"""AsyncLLMEngine: the engine's step loop on a background thread, streaming to asyncio callers.

The loop thread owns the engine; callers on any event loop submit under a lock and receive
their RequestOutput deltas through an asyncio.Queue. Torch releases the GIL during the
forward pass, so the server's event loop keeps serving HTTP while the model runs.
A caller that stops iterating (client gone, task cancelled) aborts its request and frees
its blocks. If a step raises, every in-flight request gets the error: no caller hangs.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator, Sequence

from replica.engine import EngineStats, LLMEngine, RequestOutput
from replica.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The step loop failed; the request did not complete."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="prefixgate-engine", daemon=True)
        self._thread.start()

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields one RequestOutput per new token; the last has finished=True.

        Invalid requests raise InvalidRequestError before anything is queued.
        """
        if self._stopped:
            raise EngineDeadError("engine is shut down")
        rid = request_id or uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if rid in self._streams:
                raise ValueError(f"duplicate request id {rid}")
            self._streams[rid] = (asyncio.get_running_loop(), queue)
            try:
                self.engine.add_request(prompt, params, request_id=rid, cache_salt=cache_salt)
            except BaseException:
                del self._streams[rid]
                raise
        self._wakeup.set()
        finished = False
        try:
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

    def abort(self, request_id: str) -> bool:
        with self._lock:
            self._streams.pop(request_id, None)
            return self.engine.abort(request_id)

    def stats(self) -> EngineStats:
        with self._lock:
            return self.engine.stats()

    def call(self, fn, *args):
        """Run fn(engine, *args) while the step loop is paused (e.g. a cache resync snapshot)."""
        with self._lock:
            return fn(self.engine, *args)

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stopped:
            if not self.engine.has_unfinished:
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            try:
                with self._lock:
                    outputs = self.engine.step()
                    deliveries = [(self._streams.get(o.request_id), o) for o in outputs]
                    for o in outputs:
                        if o.finished:
                            self._streams.pop(o.request_id, None)
            except Exception as e:  # fail every caller rather than leave them waiting
                self._fail_all(EngineDeadError(f"engine step failed: {e!r}"))
                continue
            for target, out in deliveries:
                if target is not None:
                    _deliver(*target, out)

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
            for rid in list(streams):
                self.engine.abort(rid)
        for loop, queue in streams.values():
            _deliver(loop, queue, error)


def _deliver(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item) -> None:
    try:
        loop.call_soon_threadsafe(queue.put_nowait, item)
    except RuntimeError:  # the caller's loop is closed: nobody is listening any more
        pass
