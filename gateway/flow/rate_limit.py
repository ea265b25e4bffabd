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
    def __init__(self, redis_url: str | None, keys: RedisKeys, share: float = 1.0, timeout_s: float = 0.25,
                 cooldown_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.redis_url, self.keys, self.share = redis_url, keys, share
        self.timeout_s, self.cooldown_s, self.clock = timeout_s, cooldown_s, clock
        self.local = LocalBuckets(clock)
        self._client = None
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
                answer = await asyncio.wait_for(self._script(tenant.name, rpm, tpm, tokens), self.timeout_s)
                if self.problem:
                    log.info("rate limits shared through Redis again")
                self.problem = None
                return verdict(answer, rpm, tpm, tokens)
            except Exception as e:
                self._down_until = self.clock() + self.cooldown_s
                if self.problem is None or not self.problem.startswith("redis"):
                    log.warning("rate limits: Redis unavailable (%r); enforcing this gateway's share", e)
                self.problem = f"redis unavailable for rate limits: {type(e).__name__}: {e}"
                await self._drop()
        lrpm = max(1, math.floor(rpm * self.share)) if rpm else 0
        ltpm = max(1, math.floor(tpm * self.share)) if tpm else 0
        return verdict(self.local.take(tenant.name, lrpm, ltpm, tokens), lrpm, ltpm, tokens)

    async def _script(self, tenant: str, rpm: int, tpm: int, tokens: int) -> list:
        from redis.exceptions import NoScriptError

        from router.index.redis_index import open_client

        if self._client is None:
            self._client = await open_client(self.redis_url, self.timeout_s)
        keys = self.keys.rate_limit(tenant)
        args = (rpm, tpm, 1, tokens)
        try:
            return await self._client.evalsha(SCRIPT_SHA, 2, *keys, *args)
        except NoScriptError:
            return await self._client.eval(RATE_LIMIT_SCRIPT, 2, *keys, *args)

    async def _drop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await asyncio.wait_for(client.aclose(), 0.5)
            except Exception:
                pass

    async def close(self) -> None:
        await self._drop()
