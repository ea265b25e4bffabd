"""The LoRA adapters a gateway serves: those configured at start and those loaded at run time.

A request's `model` names the base model or an adapter; the adapter's ref (name, path, content
digest: router/protocol/lora.py) travels with the request, so the router hashes the prompt under
the adapter's identity and a replica that lacks the adapter reads it first. Adapters loaded at
run time (`POST /v1/load_lora_adapter`) are kept in Redis (`RedisKeys.lora_adapters`), which every
gateway re-reads at most once per REFRESH_S when a request names one it does not know, so a load
or an unload reaches every gateway, and through the requests every replica, including those
started later.
"""

from __future__ import annotations

import logging
import time

import msgspec

from router.protocol.lora import AdapterRef

log = logging.getLogger("prefixgate.gateway")

REFRESH_S = 1.0  # a gateway re-reads the run-time adapters at most this often


class AdapterRegistry:
    def __init__(self, static: dict[str, AdapterRef], redis_url: str | None, key: str) -> None:
        self.static = dict(static)  # from the config: never unloaded
        self.runtime: dict[str, AdapterRef] = {}
        self.redis_url, self.key = redis_url, key
        self._read_at = float("-inf")
        self._client = None

    def _redis(self):
        if self._client is None and self.redis_url:
            from router.index.redis_index import connect

            self._client = connect(self.redis_url, 1.0)
        return self._client

    def known(self) -> dict[str, AdapterRef]:
        return {**self.runtime, **self.static}

    async def resolve(self, name: str) -> AdapterRef | None:
        """The adapter `name` names, re-reading the run-time ones if it is unknown here."""
        ref = self.static.get(name) or self.runtime.get(name)
        if ref is None and time.monotonic() - self._read_at >= REFRESH_S:
            await self.refresh()
            ref = self.runtime.get(name)
        return ref

    async def refresh(self) -> None:
        client = self._redis()
        self._read_at = time.monotonic()
        if client is None:
            return
        try:
            raw = await client.hgetall(self.key)
        except Exception as e:  # Redis away: the adapters known here still serve
            log.warning("run-time LoRA adapters not re-read: %r", e)
            return
        self.runtime = {name: msgspec.json.decode(value, type=AdapterRef) for name, value in raw.items()}

    async def add(self, ref: AdapterRef) -> None:
        self.runtime[ref.name] = ref
        client = self._redis()
        if client is not None:
            await client.hset(self.key, ref.name, msgspec.json.encode(ref).decode())

    async def remove(self, name: str) -> bool:
        """False if `name` was not a run-time adapter."""
        await self.refresh()
        found = self.runtime.pop(name, None) is not None
        client = self._redis()
        if client is not None:
            found = bool(await client.hdel(self.key, name)) or found
        return found

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
