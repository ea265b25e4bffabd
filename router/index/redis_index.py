"""The router's view of the shared index in Redis: what it costs does not grow with the fleet.

A lookup sends the prompt's block keys to the inverted index (block hash -> replicas holding
it) and samples a few holders per block: one script call per hash tag, pipelined, so a
standalone Redis answers in one round trip and a Redis Cluster in one round trip per shard, in
parallel. The work inside Redis is bounded by blocks x sample size, never by the replica count.

Redis being slow or down must never block a request: every call has a timeout of a few
milliseconds, and after a failure the index is skipped for a short cool-down so that requests
do not each pay the timeout (the router then decides from its own memory: router/decider.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError

from router.protocol.media import DEVICE, split_member
from router.protocol.redis_schema import (
    DEFAULT_KEY_PREFIX,
    INDEX_BUCKETS,
    LOOKUP_SCRIPT,
    LOOKUP_TIMEOUT_S,
    RedisKeys,
)

Client = aioredis.Redis | RedisCluster
KEY_CACHE_ENTRIES = 32_768  # encoded key names kept per router (about 10 MB at most)


@dataclass
class RedisConfig:
    url: str = "redis://127.0.0.1:6379/0"  # redis://, rediss:// (TLS), redis://:password@host
    key_prefix: str = DEFAULT_KEY_PREFIX
    timeout_s: float = LOOKUP_TIMEOUT_S
    cooldown_s: float = 1.0
    # consecutive timed-out calls before the cool-down: one late reply (a GC pause, a CPU-starved
    # gateway) costs that one decision its index, not a second of them; a lost connection trips
    # at once
    timeouts_to_trip: int = 3
    session_ttl_s: int = 1800
    buckets: int = INDEX_BUCKETS  # hash tags the block index spreads over (cluster slots)
    sample: int = 4  # holders sampled where a match ends: bounds a lookup's cost on a hot prefix
    keep: int = 12  # replicas a lookup reports at most (deepest matches first)


@dataclass
class ReplicaEntry:
    matched_blocks: int
    heartbeat: dict[str, int] = field(default_factory=dict)  # filled by the router's load table
    # of matched_blocks, how many live in a lower tier (HOST, DISK: copied back into the pool
    # before the prefill, at a price); empty: all in the device pool
    tier_blocks: dict[str, int] = field(default_factory=dict)


def tier_split(depths: dict[str, int]) -> ReplicaEntry:
    """A replica's match from the deepest block it was seen holding in each medium.

    Each medium's deepest block ends a run of that medium, which starts where the previous run
    (by depth) ended: a replica seen in the pool up to block 3 and in the host tier at block 7
    holds blocks 4-7 in the host tier; one seen only in a lower tier holds its whole match
    there (pessimistic: a lookup samples holders only where a match ends, so the pool part of a
    match that ends in a lower tier is seen only where someone else's match ends too)."""
    tiers: dict[str, int] = {}
    start = 0
    for depth, medium in sorted((d, m) for m, d in depths.items()):
        if medium != DEVICE and depth > start:
            tiers[medium] = depth - start
        start = max(start, depth)
    return ReplicaEntry(start, tier_blocks=tiers)


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
    """A plain client for one node (enough for PING, or for a standalone Redis)."""
    return aioredis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True
    )


async def open_client(url: str, timeout_s: float) -> Client:
    """The right client for whatever the URL names: a standalone Redis, or any node of a
    Redis Cluster (detected with INFO cluster, so one URL format serves both)."""
    probe = connect(url, timeout_s)
    try:
        info = await probe.info("cluster")
    except Exception:
        await probe.aclose()
        raise
    if not int(info.get("cluster_enabled", 0)):
        return probe
    await probe.aclose()
    parts = urlsplit(url)
    cluster_url = urlunsplit(parts._replace(path=""))  # a cluster has only database 0
    client = RedisCluster.from_url(
        cluster_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True
    )
    await client.initialize()
    return client


def is_cluster(client: Client) -> bool:
    return isinstance(client, RedisCluster)


def group_by_tag(keys: RedisKeys, hashes: list[int], cluster: bool) -> list[list[tuple[int, int]]]:
    """(position, block hash) groups that one script call may touch: everything at once on a
    standalone Redis, one group per hash tag on a cluster. Chain order kept inside groups."""
    if not cluster:
        return [[(i, h) for i, h in enumerate(hashes)]] if hashes else []
    groups: dict[int, list[tuple[int, int]]] = {}
    for i, h in enumerate(hashes):
        groups.setdefault(keys.bucket(h), []).append((i, h))
    return list(groups.values())


class RedisIndex:
    def __init__(self, config: RedisConfig) -> None:
        self.config = config
        self.keys = RedisKeys(config.key_prefix, config.buckets)
        self._client: Client | None = None
        self._sha: str | None = None
        self._connecting: asyncio.Lock | None = None
        self._down_until = 0.0
        self.failures = 0
        self._timeouts_in_a_row = 0
        self.lookups = 0  # Redis lookups issued (the saturation test counts them)
        # block hash -> its (block, in-flight) key names, encoded: a lookup passes 2 keys per
        # block, and hot prefixes (system prompts, a conversation's earlier turns) recur, so
        # formatting and encoding them once saves a large share of a lookup's client CPU
        self._key_cache: dict[int, tuple[bytes, bytes]] = {}

    @property
    def client(self) -> Client | None:
        return self._client

    async def _open(self) -> Client:
        if self._client is None:  # created lazily inside the router's own event loop
            if self._connecting is None:
                self._connecting = asyncio.Lock()
            async with self._connecting:
                if self._client is None:
                    client = await open_client(self.config.url, max(self.config.timeout_s, 0.5))
                    self._sha = await client.script_load(LOOKUP_SCRIPT)
                    self._client = client
        return self._client

    async def _guard(self, coro, timeout_s: float | None = None):
        if time.monotonic() < self._down_until:
            coro.close()
            raise IndexUnavailable("redis cooling down after a failure")
        try:
            result = await asyncio.wait_for(coro, timeout_s or self.config.timeout_s)
        except (TimeoutError, OSError, RuntimeError, aioredis.RedisError) as e:
            # RuntimeError: uvloop's "unable to perform operation on <TCPTransport closed=True>"
            # when the connection died under a call; it must not escape into Ray's routing loop
            self.failures += 1
            timed_out = isinstance(e, (TimeoutError, aioredis.TimeoutError))
            self._timeouts_in_a_row = self._timeouts_in_a_row + 1 if timed_out else 0
            if not timed_out or self._timeouts_in_a_row >= self.config.timeouts_to_trip:
                self._down_until = time.monotonic() + self.config.cooldown_s
                self._timeouts_in_a_row = 0
            # a lost connection: reconnect (and re-detect the topology) next time. Not on a
            # timeout (TimeoutError is an OSError too): Redis is slow, not gone, and the load
            # table keeps refreshing through this client while lookups cool down
            if not timed_out and isinstance(e, (OSError, RuntimeError, aioredis.ConnectionError)):
                self._drop_client()
            raise IndexUnavailable(f"redis unavailable: {e!r}") from e
        self._timeouts_in_a_row = 0
        return result

    def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            task = asyncio.get_running_loop().create_task(_close_quietly(client))
            task.add_done_callback(lambda _: None)

    async def _open_guarded(self) -> Client:
        if self._client is not None:
            return self._client
        # connecting (topology detection, script load) takes a few round trips: a lookup's
        # budget would turn a slow first connection into a second of fallback routing
        return await self._guard(self._open(), max(self.config.timeout_s, 1.0))

    async def lookup(
        self, hashes: list[int], replica_ids: list[str] | None = None, session_id: str | None = None
    ) -> Lookup:
        """Leading-block match of every replica seen holding this prompt's blocks (sampled),
        and the session's last replica. With `replica_ids`, exactly those replicas are
        reported (0 for the ones not seen)."""
        self.lookups += 1
        client = await self._open_guarded()
        try:
            cards, samples, session_replica = await self._guard(self._query(client, hashes, session_id))
        except IndexUnavailable as e:
            if not isinstance(e.__cause__, NoScriptError):
                raise
            self._down_until = 0.0  # Redis restarted and lost the script: load it again, retry
            self._sha = await self._guard(client.script_load(LOOKUP_SCRIPT))
            cards, samples, session_replica = await self._guard(self._query(client, hashes, session_id))
        matched = self._walk(len(hashes), cards, samples)
        if replica_ids is not None:
            matched = {rid: matched.get(rid) or ReplicaEntry(0) for rid in replica_ids}
        return Lookup(session_replica, matched)

    def _walk(self, n: int, cards: dict[int, int], samples: dict[int, list[str]]) -> dict[str, ReplicaEntry]:
        """Leading-block match per sampled replica, at most `keep` replicas, deepest first, with
        the blocks of it in lower tiers (`tier_split`).

        The chain is walked from block 0 up to the first block nobody holds. Holder counts never
        grow along a chain (holding block i+1 means holding block i, in some medium: a replica
        is one member per block), so the holders sampled at block i also hold every block up to
        the next drop in the count: that is their match. Samples are members ("rid" in the
        pool, "rid|host" in a lower tier); shallower samples of a kept replica tell where its
        runs of each medium end."""
        depth = 0
        while depth < n and cards.get(depth, 0) != 0:
            depth += 1
        if depth == 0:
            return {}
        # -1: nobody holds the block yet but a router just sent it (one holder, its own level)
        ends = [i for i in range(depth) if i == depth - 1 or cards[i] < 0 or cards[i + 1] < cards[i]]
        by_end: dict[int, list[str]] = {}
        j = 0
        for i in range(depth):
            while ends[j] < i:
                j += 1
            if samples.get(i):
                by_end.setdefault(ends[j], []).extend(samples[i])
        depths: dict[str, dict[str, int]] = {}  # replica -> medium -> deepest match seen in it
        full = False
        for end in reversed(ends):  # deepest first; a replica keeps its deepest match
            taken = 0
            for value in by_end.get(end, ()):
                rid, medium = split_member(value)
                seen = depths.get(rid)
                if seen is None:
                    if full or taken >= self.config.sample:
                        continue
                    seen = depths[rid] = {}
                    taken += 1
                seen.setdefault(medium, end + 1)
            full = full or len(depths) >= self.config.keep
        return {rid: tier_split(seen) for rid, seen in depths.items()}

    async def _query(self, client: Client, hashes: list[int], session_id: str | None):
        groups = group_by_tag(self.keys, hashes, is_cluster(client))
        pipe = client.pipeline(transaction=False)
        cache = self._key_cache
        for group in groups:
            group_keys = []
            for _, h in group:
                pair = cache.get(h)
                if pair is None:
                    if len(cache) >= KEY_CACHE_ENTRIES:
                        cache.clear()
                    pair = cache[h] = (self.keys.block(h).encode(), self.keys.inflight(h).encode())
                group_keys += pair
            pipe.execute_command("EVALSHA", self._sha, len(group_keys), *group_keys, self.config.sample)
        if session_id:
            pipe.get(self.keys.session(session_id))
        results = await pipe.execute(raise_on_error=False)
        for r in results:
            if isinstance(r, Exception):
                raise r
        cards: dict[int, int] = {}
        samples: dict[int, list[str]] = {}
        for group, (group_cards, group_samples) in zip(groups, results, strict=False):
            for (pos, _), card, sample in zip(group, group_cards, group_samples, strict=False):
                cards[pos] = card
                samples[pos] = sample
        session_replica = results[-1] if session_id else None
        return cards, samples, session_replica or None

    async def registered(self) -> list[str]:
        """The replica ids registered under this prefix (their publishers add them; garbage
        collection removes the dead), sorted."""
        client = await self._open_guarded()
        return sorted(await self._guard(client.smembers(self.keys.replicas)))

    async def mark_inflight(self, hashes: list[int], replica_id: str, ttl_ms: int) -> None:
        """Tell every router that these blocks were just sent to `replica_id`: until a replica
        publishes them (or the TTL ends), lookups count it as their holder."""
        if not hashes:
            return
        client = await self._open_guarded()
        pipe = client.pipeline(transaction=False)
        for h in hashes:
            pipe.set(self.keys.inflight(h), replica_id, px=ttl_ms)
        await self._guard(pipe.execute())

    async def remember_session(self, session_id: str, replica_id: str) -> None:
        client = await self._open_guarded()
        ttl_ms = int(self.config.session_ttl_s * 1000)
        await self._guard(client.set(self.keys.session(session_id), replica_id, px=ttl_ms))

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await _close_quietly(client)


async def _close_quietly(client: Client) -> None:
    try:
        await asyncio.wait_for(client.aclose(), 1.0)
    except Exception:
        pass
