"""The replica's stream batching (replica/serve/stream_batcher.py): tokens produced while a send
waits go out together, the first and the last at once, nothing lost or reordered, keepalives
on silence, the source's error after its outputs, and closing aborts the source."""

from __future__ import annotations

import asyncio

import pytest

from replica.core.engine_types import RequestOutput
from replica.serve.stream_batcher import batched_outputs, coalesce


def _out(i: int, finished: bool = False, logprobs: bool = False) -> RequestOutput:
    return RequestOutput("r", [i], f"t{i} ", [], "", 5, 0, finished, "length" if finished else None,
                         logprobs=[{"token_id": i, "logprob": -float(i)}] if logprobs else None)


class Feed:
    """A source the test drives: put() outputs, fail(), and see whether it was closed."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = asyncio.Event()

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        try:
            while True:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.closed.set()


def test_coalesce_joins_deltas_and_keeps_the_last_state():
    merged = coalesce([_out(1, logprobs=True), _out(2), _out(3, finished=True, logprobs=True)])
    assert merged.new_token_ids == [1, 2, 3]
    assert merged.new_text == "t1 t2 t3 "
    assert [e["token_id"] for e in merged.logprobs] == [1, 3]
    assert merged.finished and merged.finish_reason == "length"


async def _collect(gen, n: int) -> list:
    got = []
    async for item in gen:
        got.append(item)
        if len(got) == n:
            break
    return got


def test_tokens_produced_while_waiting_go_out_together():
    async def main():
        feed = Feed()
        gen = batched_outputs(aiter(feed), interval_s=60.0, keepalive_s=60.0)
        feed.queue.put_nowait(_out(0))
        first = await anext(gen)  # the first output goes at once, whatever the interval
        assert first.new_token_ids == [0]
        for i in range(1, 6):
            feed.queue.put_nowait(_out(i))
        feed.queue.put_nowait(_out(6, finished=True))  # the end is sent at once: no 60 s wait
        second = await anext(gen)
        assert second.new_token_ids == [1, 2, 3, 4, 5, 6] and second.finished
        with pytest.raises(StopAsyncIteration):
            await anext(gen)

    asyncio.run(main())


def test_zero_interval_sends_whatever_is_buffered():
    async def main():
        feed = Feed()
        for i in range(4):
            feed.queue.put_nowait(_out(i, finished=i == 3))
        got = [o async for o in batched_outputs(aiter(feed), interval_s=0.0, keepalive_s=60.0)]
        assert [t for o in got for t in o.new_token_ids] == [0, 1, 2, 3]
        assert got[-1].finished

    asyncio.run(main())


def test_silence_yields_keepalives_then_the_output():
    async def main():
        feed = Feed()
        gen = batched_outputs(aiter(feed), interval_s=0.0, keepalive_s=0.01)
        assert await anext(gen) is None  # nothing yet: a keepalive
        feed.queue.put_nowait(_out(0, finished=True))
        while (item := await anext(gen)) is None:
            pass
        assert item.new_token_ids == [0] and item.finished

    asyncio.run(main())


def test_source_error_comes_after_its_outputs():
    async def main():
        feed = Feed()
        feed.queue.put_nowait(_out(0))
        feed.queue.put_nowait(_out(1))
        feed.queue.put_nowait(RuntimeError("engine died"))
        gen = batched_outputs(aiter(feed), interval_s=0.0, keepalive_s=60.0)
        got = []
        with pytest.raises(RuntimeError, match="engine died"):
            async for item in gen:
                got.append(item)
        assert [t for o in got for t in o.new_token_ids] == [0, 1]

    asyncio.run(main())


def test_closing_early_closes_the_source():
    async def main():
        feed = Feed()
        feed.queue.put_nowait(_out(0))
        gen = batched_outputs(aiter(feed), interval_s=0.0, keepalive_s=60.0)
        assert (await anext(gen)).new_token_ids == [0]
        await gen.aclose()  # client gone: the request must be aborted
        await asyncio.wait_for(feed.closed.wait(), 10)

    asyncio.run(main())
