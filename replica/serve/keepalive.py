"""Keepalive markers in a replica's output stream: the gateway's stall guard reads them.

A request can legitimately go seconds without output (waiting for a batch slot, a long
prefill); a frozen or wedged replica goes silent for good. `with_keepalive` yields None
whenever its source has produced nothing for `every_s`, so the replica can send an "alive"
chunk and the gateway can bound the silence it accepts (gateway/migration.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")


async def with_keepalive(source: AsyncIterator[T], every_s: float) -> AsyncIterator[T | None]:
    """The items of `source`, with None after every `every_s` of silence. Closing this
    generator cancels the pending read and closes `source` (which aborts its request)."""
    it = source.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=every_s)
            if not done:
                yield None
                continue
            read, pending = pending, None
            try:
                item = read.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            await asyncio.wait({pending})  # let the source see its cancellation before aclose
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
