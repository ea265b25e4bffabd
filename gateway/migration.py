"""No request lost when a replica dies: retry before the first token, migrate after it.

The gateway holds all a request needs to run again: the prompt token ids, the sampling
parameters and the tokens already sent. When a replica stream fails (the replica process
died, Serve raised, or the replica answered with a retryable 503 because it is shutting down
or its engine failed), this wrapper sends the request to another replica:

* before any token was sent: the same request again, same seed (a plain retry);
* after tokens were sent: a continuation. The prompt stays the same and the tokens already
  sent go along as `prefix_output_token_ids`, so the new replica treats them as its own
  output: max_tokens, stop strings, text (no duplicated or missing characters) and usage
  count them. The new replica recomputes prompt + sent tokens (minus whatever it has cached);
  that recompute is logged and counted per migration. Greedy output continues identically
  (up to rounding at near-ties); seeded sampling continues from a seed derived from the
  request's seed and the number of tokens sent, so a rerun of the same failure is reproducible.

The caller sees one stream: one "start" per replica tried (the last one names the replica),
deltas, one "end". Attempts and total time are bounded; past them the stream ends with a 503
error chunk (`exhausted`), which the gateway turns into a 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec

from gateway import metrics as m
from router.protocol.messages import (
    AliveChunk,
    Chunk,
    DeltaChunk,
    EndChunk,
    ErrorChunk,
    GenerateRequest,
    decode_chunk,
)

log = logging.getLogger("prefixgate.migration")


@dataclass
class MigrationPolicy:
    max_attempts: int = 6  # replica calls per request, the first included
    budget_s: float = 90.0  # from the first failure: past it, give up with a 503
    backoff_s: float = 0.25  # doubled per attempt (Serve needs a moment to drop a dead replica)
    max_backoff_s: float = 4.0
    # after a replica's "start", the longest silence accepted (it sends "alive" chunks every
    # KEEPALIVE_S while working): past it the replica is taken for frozen and the request moves
    stall_timeout_s: float = 30.0


class ReplicaStalled(Exception):
    """A replica that took the request stopped sending anything, keepalives included."""


@dataclass
class MigrationRecord:
    """One failure and what was resent because of it."""

    attempt: int
    reason: str
    sent_tokens: int  # output tokens the client already had
    recompute_tokens: int  # prompt + sent tokens the next replica must prefill (before its cache)


def derive_seed(seed: int, sent_tokens: int) -> int:
    """Seed for a continuation after `sent_tokens` tokens: fixed for a given request and cut
    point, different from the original so the continuation does not replay its draws."""
    return (seed * 1_000_003 + sent_tokens * 7_919 + 1) % 2**63


def continuation(req: GenerateRequest, sent_ids: list[int], sent_text_len: int) -> GenerateRequest:
    params = req.params
    if sent_ids and params.seed is not None:
        params = msgspec.structs.replace(params, seed=derive_seed(params.seed, len(sent_ids)))
    return msgspec.structs.replace(
        req, params=params, request_id=uuid.uuid4().hex,
        prefix_output_token_ids=list(sent_ids), prefix_text_len=sent_text_len,
    )


def _inc(name: str, *labels: str, amount: float = 1) -> None:
    metric = getattr(m, name, None)  # defined in gateway/metrics.py
    if metric is not None:
        (metric.labels(*labels) if labels else metric).inc(amount)


class ResilientStream:
    """Chunks of one request, continued on another replica whenever one fails."""

    def __init__(self, call: Callable[[GenerateRequest], AsyncIterator[bytes]], req: GenerateRequest,
                 policy: MigrationPolicy, retryable: tuple[type[BaseException], ...]) -> None:
        self.call, self.req, self.policy, self.retryable = call, req, policy, retryable
        self.sent_ids: list[int] = []
        self.sent_text_len = 0
        self.migrations: list[MigrationRecord] = []

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        first_failure: float | None = None
        for attempt in range(1, self.policy.max_attempts + 1):
            req = continuation(self.req, self.sent_ids, self.sent_text_len) if attempt > 1 else self.req
            failure: str | None = None
            stream = self.call(req)
            try:
                async for chunk in _guarded(stream, self.policy.stall_timeout_s):
                    if isinstance(chunk, ErrorChunk) and chunk.retry:
                        failure = chunk.message
                        break
                    if isinstance(chunk, DeltaChunk):
                        self.sent_ids += chunk.token_ids
                        self.sent_text_len += len(chunk.text)
                    elif isinstance(chunk, EndChunk):
                        yield self._final(chunk)
                        return
                    yield chunk
                    if isinstance(chunk, ErrorChunk):
                        return  # the request itself is bad: no other replica would do better
                else:
                    failure = "the replica stream ended without finishing"
            except (*self.retryable, ReplicaStalled) as e:
                failure = f"{type(e).__name__}: {e}"
            finally:
                await _close(stream)
            now = time.monotonic()
            first_failure = first_failure or now
            self._record(attempt, failure)
            if attempt == self.policy.max_attempts or now - first_failure > self.policy.budget_s:
                break
            delay = min(self.policy.backoff_s * 2 ** (attempt - 1), self.policy.max_backoff_s)
            await asyncio.sleep(min(delay, max(0.0, first_failure + self.policy.budget_s - now)))
        if self.sent_ids:
            _inc("MIGRATIONS", "failed")
        yield ErrorChunk(503, f"no replica could complete this request after {len(self.migrations)} failure(s); "
                         "retry shortly", exhausted=True)

    def _record(self, attempt: int, failure: str) -> None:
        sent = len(self.sent_ids)
        rec = MigrationRecord(attempt, failure, sent, len(self.req.prompt_token_ids) + sent)
        self.migrations.append(rec)
        if sent:
            _inc("MIGRATION_RECOMPUTED_TOKENS", amount=rec.recompute_tokens)
            log.warning("request %s: replica failed after %d tokens (%s); continuing elsewhere, "
                        "recomputing %d tokens", self.req.request_id, sent, failure, rec.recompute_tokens)
        else:
            _inc("RETRIES")
            log.warning("request %s: replica failed before the first token (%s); retrying",
                        self.req.request_id, failure)

    def _final(self, end: EndChunk) -> EndChunk:
        resumed = [r for r in self.migrations if r.sent_tokens]
        for _ in resumed:
            _inc("MIGRATIONS", "resumed")
        # cached_tokens is about the prompt; a continuation may also hit its own sent tokens
        return msgspec.structs.replace(end, cached_tokens=min(end.cached_tokens, end.prompt_tokens),
                                       migrations=[dataclasses.asdict(r) for r in self.migrations])


async def _guarded(stream: AsyncIterator[bytes], stall_timeout_s: float) -> AsyncIterator[Chunk]:
    """The replica's chunks, decoded and type-checked, without its keepalives; once it has
    started the request, a silence longer than `stall_timeout_s` raises ReplicaStalled. Before
    "start" there is no bound: the request may be waiting in Serve's queue for a free replica,
    which is not a fault. A chunk that does not decode ends the request with a 502: a replica
    speaking another protocol version would fail the same way on every retry."""
    started = False
    while True:
        # asyncio.timeout, not wait_for: no task per chunk, and a cancelled caller is cancelled
        # at once (wait_for may return a read that finished as it was cancelled)
        guard = asyncio.timeout(stall_timeout_s if started and stall_timeout_s > 0 else None)
        try:
            async with guard:
                raw = await anext(stream)
        except StopAsyncIteration:
            return
        except TimeoutError:
            if not guard.expired():  # the stream's own TimeoutError (e.g. Ray's GetTimeoutError)
                raise
            raise ReplicaStalled(f"no output or keepalive for {stall_timeout_s:g} s") from None
        try:
            chunk = decode_chunk(raw)
        except (msgspec.ValidationError, msgspec.DecodeError, TypeError) as e:
            log.error("malformed chunk from a replica: %s", e)
            yield ErrorChunk(502, f"a replica sent a malformed stream chunk: {e}")
            return
        if isinstance(chunk, AliveChunk):
            continue
        started = True
        yield chunk


async def _close(stream) -> None:
    """Stop the replica's work when we leave its stream early (no-op when it completed)."""
    cancel = getattr(stream, "cancel", None)
    if cancel is not None:
        cancel()
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:
            pass
