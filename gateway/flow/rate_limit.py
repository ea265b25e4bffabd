"""Requests and tokens per minute per tenant, for every gateway together.

Each tenant with limits (`rpm`, `tpm` in the API-key file) has two token buckets in Redis,
refilled continuously (a minute refills a whole limit); an admission takes one request and
the request's tokens (prompt + n x max_tokens, OpenAI's estimate) from both at once in ONE script
call (router/protocol/redis_schema.py RATE_LIMIT_SCRIPT), or from neither. Refused: 429 with
Retry-After and code `rate_limit_exceeded`. Every response of a limited tenant carries
OpenAI's headers: x-ratelimit-{limit,remaining,reset}-{requests,tokens}, resets as durations
("1s", "6m0s": until the bucket is full again).

Redis away (an error or a timeout): this gateway enforces its local share of each limit
(limit / gateways) in process, says so in /health (`rate_limits: local`), and tries Redis
again after a cool-down.

The connection (topology detection, the script's load: a few round trips) is made once, by one
task that every admission waiting for it shares, on its own budget (`connect_timeout_s`), not
an admission's: an admission is then one script call within `timeout_s`. Until Redis has failed
once, admissions wait for that connection, so a gateway that has just started never answers
with its local share because its first connection, on a busy machine, took more than one
admission's budget; a refused connection still fails at once. After a failure, reconnecting goes
on in the background while admissions use the local share.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.flow.keys import TenantSpec
from router.protocol.redis_schema import RATE_LIMIT_SCRIPT, RedisKeys

log = logging.getLogger("prefixgate.flow")
SCRIPT_SHA = hashlib.sha1(RATE_LIMIT_SCRIPT.encode()).hexdigest()


def duration(ms: float) -> str:
    """A wait as OpenAI writes it (Go's time.Duration): "20ms", "1s", "1.5s", "6m0s", "1h2m3s"."""
    ms = max(0, int(math.ceil(ms)))
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{seconds}s"
    if minutes:
        return f"{minutes}m{seconds}s"
    return f"{seconds}s"


@dataclass
class Verdict:
    allowed: bool
    headers: dict[str, str]  # x-ratelimit-* (empty for a tenant without limits)
    retry_after_ms: int = 0  # refused: when the request would fit; -1: never (over the limit itself)
    refused_by: str | None = None  # "requests" or "tokens"
    limit: int = 0  # the refusing limit, as enforced (a local share while Redis is away)


def verdict(answer: list, rpm: int, tpm: int, tokens: int) -> Verdict:
    """The script's answer (or the local buckets', in the same shape) as a Verdict."""
    allowed, req_left, tok_left, req_reset, tok_reset, wait = (int(x) for x in answer)
    headers: dict[str, str] = {}
    if rpm:
        headers |= {"x-ratelimit-limit-requests": str(rpm), "x-ratelimit-remaining-requests": str(max(req_left, 0)),
                    "x-ratelimit-reset-requests": duration(req_reset)}
    if tpm:
        headers |= {"x-ratelimit-limit-tokens": str(tpm), "x-ratelimit-remaining-tokens": str(max(tok_left, 0)),
                    "x-ratelimit-reset-tokens": duration(tok_reset)}
    if allowed:
        return Verdict(True, headers)
    by = "requests" if rpm and (req_left < 1) else "tokens"
    if tpm and tokens > tpm:
        by = "tokens"
    return Verdict(False, headers, wait, by, rpm if by == "requests" else tpm)


class LocalBuckets:
    """The same buckets in this process (RATE_LIMIT_SCRIPT's arithmetic), for a share of each limit."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._buckets: dict[tuple[str, str], tuple[float, float]] = {}  # (tenant, kind) -> (level, at ms)

    def take(self, tenant: str, rpm: int, tpm: int, tokens: int) -> list[int]:
        now = self.clock() * 1000
        limits, costs = (rpm, tpm), (1, tokens)
        levels: list[float] = [0.0, 0.0]
        allowed, wait = 1, 0
        for i, kind in enumerate(("req", "tok")):
            limit = limits[i]
            if limit <= 0:
                continue
            level, at = self._buckets.get((tenant, kind), (limit, now))
            level = min(limit, level + (now - at) * limit / 60000)
            levels[i] = level
            if costs[i] > limit:
                allowed, wait = 0, -1
            elif level < costs[i]:
                allowed = 0
                if wait >= 0:
                    wait = max(wait, math.ceil((costs[i] - level) * 60000 / limit))
        out = [allowed, -1, -1, 0, 0, wait]
        for i, kind in enumerate(("req", "tok")):
            limit = limits[i]
            if limit <= 0:
                continue
            level = levels[i]
            if allowed:
                level -= costs[i]
                self._buckets[(tenant, kind)] = (level, now)
            out[1 + i] = math.floor(level)
            out[3 + i] = math.ceil((limit - level) * 60000 / limit)
        return out


class RateLimiter:
    TIMEOUT_S = 0.25  # an admission's budget for its one script call (the gateway: this or its redis_timeout_s)

    def __init__(self, redis_url: str | None, keys: RedisKeys, share: float = 1.0, timeout_s: float = TIMEOUT_S,
                 cooldown_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 connect_timeout_s: float = 5.0) -> None:
        self.redis_url, self.keys, self.share = redis_url, keys, share
        self.timeout_s, self.cooldown_s, self.clock = timeout_s, cooldown_s, clock
        self.connect_timeout_s = max(connect_timeout_s, timeout_s)
        self.local = LocalBuckets(clock)
        self._client = None
        self._connecting: asyncio.Task | None = None  # the one connection attempt in progress
        self._down_until = 0.0
        self.problem: str | None = None if redis_url else "no Redis configured"

    @property
    def mode(self) -> str:
        """"shared" (Redis: the limits hold for all gateways together) or "local" (this gateway's share)."""
        return "local" if self.problem else "shared"

    async def admit(self, tenant: TenantSpec, tokens: int) -> Verdict:
        rpm, tpm = tenant.rpm or 0, tenant.tpm or 0
        if not (rpm or tpm):
            return Verdict(True, {})
        if self.redis_url and self.clock() >= self._down_until:
            try:
                client = await self._connected()
                answer = await asyncio.wait_for(self._script(client, tenant.name, rpm, tpm, tokens), self.timeout_s)
                if self.problem:
                    log.info("rate limits shared through Redis again")
                self.problem = None
                return verdict(answer, rpm, tpm, tokens)
            except Exception as e:
                self._down_until = self.clock() + self.cooldown_s
                if self.problem is None or not self.problem.startswith("redis"):
                    log.warning("rate limits: Redis unavailable (%r); enforcing this gateway's share", e)
                self.problem = f"redis unavailable for rate limits: {type(e).__name__}: {e}"
                if not isinstance(e, TimeoutError):  # a timeout: Redis is slow, not gone; keep the connection
                    await self._drop()
        lrpm = max(1, math.floor(rpm * self.share)) if rpm else 0
        ltpm = max(1, math.floor(tpm * self.share)) if tpm else 0
        return verdict(self.local.take(tenant.name, lrpm, ltpm, tokens), lrpm, ltpm, tokens)

    async def _connected(self):
        """The client, connected by one attempt that concurrent admissions share (shielded: an
        admission whose request goes away does not cancel it). Before any failure an admission
        waits for it (`connect_timeout_s` bounds it); after one, at most `timeout_s`, while the
        attempt goes on for the admissions after it."""
        if self._client is not None:
            return self._client
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
            self._connecting.add_done_callback(self._connected_or_not)
        wait = self.timeout_s if self.problem else None
        return await asyncio.wait_for(asyncio.shield(self._connecting), wait)

    def _connected_or_not(self, task: asyncio.Task) -> None:
        connected = not task.cancelled() and task.exception() is None
        if self._connecting is task:
            self._connecting = None
            if connected:
                self._client = task.result()
        elif connected:  # the limiter closed while it connected: nobody will use this client
            task.get_loop().create_task(_close_quietly(task.result()))

    async def _connect(self):
        from router.index.redis_index import open_client

        async def connect():
            client = await open_client(self.redis_url, self.connect_timeout_s)
            try:
                await client.script_load(RATE_LIMIT_SCRIPT)
            except BaseException:
                await _close_quietly(client)
                raise
            return client

        return await asyncio.wait_for(connect(), self.connect_timeout_s)

    async def _script(self, client, tenant: str, rpm: int, tpm: int, tokens: int) -> list:
        from redis.exceptions import NoScriptError

        keys = self.keys.rate_limit(tenant)
        args = (rpm, tpm, 1, tokens)
        try:
            return await client.evalsha(SCRIPT_SHA, 2, *keys, *args)
        except NoScriptError:  # Redis restarted (or failed over) since the script was loaded
            return await client.eval(RATE_LIMIT_SCRIPT, 2, *keys, *args)

    async def _drop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await _close_quietly(client)

    async def close(self) -> None:
        connecting, self._connecting = self._connecting, None
        if connecting is not None:
            connecting.cancel()
        await self._drop()


async def _close_quietly(client) -> None:
    try:
        await asyncio.wait_for(client.aclose(), 0.5)
    except Exception:
        pass
