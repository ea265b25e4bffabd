"""One admitted request: its n replica streams, usage accounting, JSON or SSE rendering."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from gateway import metrics as m
from gateway.errors import APIError
from gateway.logprobs import LogprobsView
from gateway.slo_watch import SloWatch
from router.protocol.messages import DeltaChunk, EndChunk, ErrorChunk, RouteDecision, StartChunk


class RequestRun:
    """One admitted request: its n replica streams and the bookkeeping around them."""

    slo: SloWatch | None = None  # its latency objectives' timings, when it has any (gateway/slo_watch.py)

    def __init__(self, gw, model, body, streams, chat: bool, arrival: float, prompt_tokens: int) -> None:
        self.gw, self.model, self.body, self.streams, self.chat, self.arrival = gw, model, body, streams, chat, arrival
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.first: list[list[dict]] = []
        self.replica = None
        self.route: RouteDecision | None = None  # the router's decision, as the replica was sent it
        self.ends: dict[int, dict] = {}
        self._closed = False
        self._first_token_seen = False
        self.logprobs = LogprobsView(chat, body, len(streams))  # OpenAI's logprobs shapes

    async def start(self) -> dict[str, str]:
        """Read each stream up to its first token (or end/error) so headers name the replica."""
        if self.slo is not None:
            self.slo.routing(time.monotonic())  # reading a stream first is what routes it
        for index in range(len(self.streams)):
            head = await self._head(index)
            error = next((c for c in head if isinstance(c, ErrorChunk)), None)
            if error is not None:
                raise self._failed(_error(error))
            self.first.append(head)
        self._mark_first_token()
        reason = (self.route.reason or "unknown") if self.route is not None else self.gw.config.policy
        m.ROUTES.labels(self.model.name, self.replica or "unknown", reason).inc()
        return {"x-prefixgate-replica": self.replica or "unknown", "x-prefixgate-route": reason}

    async def _head(self, index: int) -> list:
        head = []
        async for chunk in self.streams[index]:
            head.append(chunk)
            if isinstance(chunk, StartChunk):
                if index == 0:  # the last start wins: a retry names the replica that took over
                    self.replica = chunk.replica
                    self.route = chunk.route
                    if self.slo is not None:  # the router's p90 for that replica (None: it made none)
                        self.slo.prediction = chunk.route.prediction if chunk.route is not None else None
                continue
            if self.slo is not None and not isinstance(chunk, ErrorChunk):
                at = time.monotonic()
                self.slo.first_token(index, at)
                if isinstance(chunk, EndChunk):
                    self.slo.ended(index, at, chunk.completion_tokens)
            break
        return head

    def _mark_first_token(self) -> None:
        if not self._first_token_seen:
            self._first_token_seen = True
            m.TTFT.labels(self.model.name).observe(time.monotonic() - self.arrival)

    async def _chunks(self, index: int) -> AsyncIterator[dict]:
        for chunk in self.first[index]:
            if not isinstance(chunk, StartChunk):
                yield chunk
        async for chunk in self.streams[index]:
            if not isinstance(chunk, StartChunk):
                yield chunk

    async def _merged(self) -> AsyncIterator[tuple[int, dict]]:
        if len(self.streams) == 1:
            async for chunk in self._chunks(0):
                yield 0, chunk
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for chunk in self._chunks(i):
                    await queue.put((i, chunk))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self.streams))]
        try:
            done = 0
            while done < len(tasks):
                i, chunk = await queue.get()
                if chunk is None:
                    done += 1
                else:
                    yield i, chunk
        finally:
            for t in tasks:
                t.cancel()

    def _failed(self, error: APIError) -> APIError:
        """The error the request ends with; its objectives, if any, count as missed (a 5xx)."""
        if self.slo is not None:
            self.slo.failed(error.status)
        return error

    def _account(self, index: int, end: EndChunk) -> None:
        self.ends[index] = end
        if self.slo is not None:
            self.slo.ended(index, time.monotonic(), end.completion_tokens)
        replica = self.replica or "unknown"
        if index == 0:
            m.PROMPT_TOKENS.labels(replica).inc(end.prompt_tokens)
            m.CACHED_TOKENS.labels(replica).inc(end.cached_tokens)
        m.COMPLETION_TOKENS.labels(replica).inc(end.completion_tokens)

    def migrations(self) -> list[dict]:
        """Replica failures this request survived (gateway/migration.py), all choices together."""
        return [r for i in sorted(self.ends) for r in self.ends[i].migrations]

    def usage(self) -> dict:
        completion = sum(e.completion_tokens for e in self.ends.values())
        cached = self.ends[0].cached_tokens if 0 in self.ends else 0
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def collect(self) -> dict:
        texts = [""] * len(self.streams)
        reasons: list[str | None] = [None] * len(self.streams)
        async for i, chunk in self._merged():
            if isinstance(chunk, DeltaChunk):
                texts[i] += chunk.text
                self.logprobs.add(i, chunk)
            elif isinstance(chunk, EndChunk):
                reasons[i] = chunk.finish_reason
                self._account(i, chunk)
            elif isinstance(chunk, ErrorChunk):
                raise self._failed(_error(chunk))
        m.E2E.labels(self.model.name).observe(time.monotonic() - self.arrival)
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": r,
                        "logprobs": self.logprobs.whole(i)}
                       for i, (t, r) in enumerate(zip(texts, reasons, strict=True))]
            obj = "chat.completion"
        else:
            choices = [{"index": i, "text": t, "finish_reason": r, "logprobs": self.logprobs.whole(i)}
                       for i, (t, r) in enumerate(zip(texts, reasons, strict=True))]
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.body.model,
                "choices": choices, "usage": self.usage(),
                "prefixgate": {"replica": self.replica, "route": self.route.as_dict() if self.route is not None else None,
                               "migrations": self.migrations()}}

    def _sse(self, choices: list[dict], usage: dict | None = None) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        payload = {"id": self.id, "object": obj, "created": self.created, "model": self.body.model, "choices": choices}
        if usage is not None:
            payload["usage"] = usage
        return f"data: {json.dumps(payload)}\n\n"

    async def sse(self) -> AsyncIterator[str]:
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        # no chunk with choices before a choice's first token (its TTFT means a token): the
        # assistant role rides on the first delta of each choice, not on a chunk of its own
        roled: set[int] = set()

        def delta(i: int, content: dict) -> dict:
            if i in roled:
                return content
            roled.add(i)
            return {"role": "assistant", **content}

        try:
            async for i, chunk in self._merged():
                if isinstance(chunk, DeltaChunk) and (chunk.text or chunk.logprobs):
                    piece = {"delta": delta(i, {"content": chunk.text})} if self.chat else {"text": chunk.text}
                    yield self._sse([{"index": i, **piece, "finish_reason": None,
                                      "logprobs": self.logprobs.piece(i, chunk)}])
                elif isinstance(chunk, EndChunk):
                    self._account(i, chunk)
                    piece = {"delta": delta(i, {})} if self.chat else {"text": ""}
                    yield self._sse([{"index": i, **piece, "finish_reason": chunk.finish_reason, "logprobs": None}])
                elif isinstance(chunk, ErrorChunk):
                    err = self._failed(_error(chunk))
                    yield f"data: {json.dumps(err.body())}\n\n"
                    break
            if include_usage and len(self.ends) == len(self.streams):
                yield self._sse([], usage=self.usage())
            m.E2E.labels(self.model.name).observe(time.monotonic() - self.arrival)
            yield "data: [DONE]\n\n"
        finally:
            self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.slo is not None:
                self.slo.close()
            self.model.flow.finished(len(self.streams))
            m.IN_FLIGHT.set(self.gw.in_flight)
            for s in self.streams:
                asyncio.ensure_future(s.aclose())


def _error(chunk: ErrorChunk) -> APIError:
    """An error chunk as the HTTP error to answer: 503s (no replica could finish) say when to retry."""
    code = chunk.code
    if code < 500:
        return APIError(code, chunk.message, "invalid_request_error", code="model_not_found" if code == 404 else None)
    headers = {"Retry-After": "2"} if code == 503 else None
    return APIError(code, chunk.message, "server_error", code="replica_unavailable" if code == 503 else None,
                    headers=headers)
