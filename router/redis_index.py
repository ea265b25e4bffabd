"""The router's view of the shared index in Redis: one scripted round trip per decision.

Redis being slow or down must never block a request: every call has a timeout of a few
milliseconds, and after a failure the index is skipped for a short cool-down so that requests
do not each pay the timeout (the router then falls back to consistent hashing).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis

from router.protocol.redis_schema import HEARTBEAT_FIELDS, LOOKUP_SCRIPT, RedisKeys


@dataclass
class RedisConfig:
    url: str = "redis://127.0.0.1:6379/0"  # redis://, rediss:// (TLS), redis://:password@host
    key_prefix: str = "prefixgate"
    timeout_s: float = 0.02
    cooldown_s: float = 1.0
    session_ttl_s: int = 1800


@dataclass
class ReplicaEntry:
    matched_blocks: int
    heartbeat: dict[str, int]  # empty when the replica's heartbeat has expired


@dataclass
class Lookup:
    session_replica: str | None
    replicas: dict[str, ReplicaEntry] = field(default_factory=dict)


class IndexUnavailable(RuntimeError):
    """Redis did not answer in time (or is cooling down after a failure)."""


def redact(url: str) -> str:
    """The URL without its password, for logs and messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def connect(url: str, timeout_s: float) -> aioredis.Redis:
    return aioredis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True
    )


class RedisIndex:
    def __init__(self, config: RedisConfig) -> None:
        self.config = config
        self.keys = RedisKeys(config.key_prefix)
        self._client: aioredis.Redis | None = None
        self._lookup = None
        self._down_until = 0.0
        self.failures = 0

    def _ensure(self) -> None:
        if self._client is None:  # created lazily inside the router's own event loop
            self._client = connect(self.config.url, max(self.config.timeout_s, 0.5))
            self._lookup = self._client.register_script(LOOKUP_SCRIPT)

    async def _guard(self, coro):
        if time.monotonic() < self._down_until:
            coro.close()
            raise IndexUnavailable("redis cooling down after a failure")
        try:
            return await asyncio.wait_for(coro, self.config.timeout_s)
        except (TimeoutError, OSError, aioredis.RedisError) as e:
            self.failures += 1
            self._down_until = time.monotonic() + self.config.cooldown_s
            raise IndexUnavailable(f"redis unavailable: {e!r}") from e

    async def lookup(self, hashes: list[int], replica_ids: list[str], session_id: str | None) -> Lookup:
        self._ensure()
        session_key = self.keys.session(session_id) if session_id else ""
        args = [self.config.key_prefix, session_key, len(replica_ids), *replica_ids, *hashes]
        raw = await self._guard(self._lookup(args=args))
        result = Lookup(session_replica=raw[0] or None)
        for rid, matched, hb in raw[1:]:
            fields = {k: int(v or 0) for k, v in zip(HEARTBEAT_FIELDS, hb, strict=True)} if hb else {}
            result.replicas[rid] = ReplicaEntry(int(matched), fields)
        return result

    async def remember_session(self, session_id: str, replica_id: str) -> None:
        self._ensure()
        ttl_ms = int(self.config.session_ttl_s * 1000)
        await self._guard(self._client.set(self.keys.session(session_id), replica_id, px=ttl_ms))

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            try:
                await asyncio.wait_for(client.aclose(), 1.0)
            except Exception:
                pass
