"""A request's engine outputs, sent in batches: every token produced since the last send.

Sending each token as its own chunk costs the same fixed work per token all the way to the
client (a Ray object, a decode, an SSE event): on a small CPU that path, not the engine, caps
the tokens per second. Here one task per request reads the backend's stream into a buffer, and
the replica takes the whole buffer at once as one output: the first token at once, then at most
one send per `interval_s` while tokens keep coming (the end of a stream is sent at once). With
nothing new for `keepalive_s` it yields None, so the replica can send a keepalive; that needs a
timer per silence, not a future per token.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace

from replica.core.engine_types import RequestOutput


def coalesce(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: their new tokens, text and logprobs joined,
    everything else (usage, finish, timings) from the last."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    logprobs = None
    if any(o.logprobs for o in outputs):
        logprobs = [entry for o in outputs for entry in (o.logprobs or ())]
    return replace(last, new_token_ids=[t for o in outputs for t in o.new_token_ids],
                   new_text="".join(o.new_text for o in outputs), logprobs=logprobs)


async def batched_outputs(source: AsyncIterator[RequestOutput], interval_s: float,
                          keepalive_s: float) -> AsyncIterator[RequestOutput | None]:
    """`source`'s outputs, coalesced as described above; None after each `keepalive_s` of
    silence. An error of `source` is raised after the outputs that came before it. Closing this
    generator cancels the reader and closes `source` (which aborts its request)."""
    loop = asyncio.get_running_loop()
    buffer: list[RequestOutput] = []
    waiter: asyncio.Future | None = None
    want_any = True  # the consumer waits for any output (else only for the end, within an interval)
    ended = False
    error: BaseException | None = None

    def wake(timed_out: bool = False) -> None:
        if waiter is not None and not waiter.done():
            waiter.set_result(timed_out)

    async def read() -> None:
        nonlocal ended, error
        try:
            async for out in source:
                buffer.append(out)
                if want_any or out.finished:
                    wake()
        except Exception as e:  # delivered to the consumer after what came before it
            error = e
        finally:
            ended = True
            wake()

    async def sleep(seconds: float, any_output: bool) -> bool:
        """Wait up to `seconds` for an output (any, or only the last); True if none came."""
        nonlocal waiter, want_any
        waiter, want_any = loop.create_future(), any_output
        timer = loop.call_later(seconds, wake, True)
        try:
            return await waiter
        finally:
            timer.cancel()
            waiter = None

    reader = loop.create_task(read())
    last_sent = float("-inf")
    try:
        while True:
            if not buffer and not ended:
                if await sleep(keepalive_s, any_output=True) and not buffer and not ended:
                    yield None
                continue
            if buffer:
                wait = last_sent + interval_s - loop.time()
                if wait > 0 and not buffer[-1].finished and not ended:
                    await sleep(wait, any_output=False)  # let more tokens join this send
                batch = buffer[:]
                buffer.clear()
                out = coalesce(batch)
                last_sent = loop.time()
                yield out
                if out.finished:
                    return
                continue
            if error is not None:
                raise error
            return
    finally:
        if not reader.done():
            reader.cancel()
        await asyncio.wait({reader})  # its error, if any, was ours to raise above
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
