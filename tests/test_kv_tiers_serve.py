"""The host tier in the real stack: a prefix pushed out of a replica's pool is
published as held in host memory, stays routed to that replica, and comes back as a cache hit."""

from __future__ import annotations

import time
import uuid

import redis

from router.protocol.media import DEVICE, HOST, member, split_entry
from router.protocol.redis_schema import RedisKeys
from tests.helpers.stack import chat

SYSTEM = ("You are the archivist of the Lighthouse Library. You answer questions about opening hours, "
          "loans, rare books and the reading room, briefly and precisely. ") * 4


def _entries(client: redis.Redis, keys: RedisKeys, rid: str) -> dict[int, str]:
    return dict(split_entry(e) for e in client.smembers(keys.blocks(rid)))


def _wait(what: str, check, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s  # replicas publish asynchronously: wait for the index
    while not (value := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return value


def test_prefix_evicted_to_host_is_published_routed_and_hit(stack):
    tag = uuid.uuid4().hex[:6]
    system = f"Archive {tag}. " + SYSTEM
    session = f"tiers-{tag}"
    keys = RedisKeys(stack.config.key_prefix)
    client = redis.Redis.from_url(stack.config.redis_url, decode_responses=True)

    def ask(messages, session=session):
        r = chat(stack, messages, session, max_tokens=4)
        assert r.status_code == 200, r.text
        return r

    question = [{"role": "system", "content": system}, {"role": "user", "content": "When do you open?"}]
    before = {rid: set(_entries(client, keys, rid)) for rid in client.smembers(keys.replicas)}
    first = ask(question)
    home = first.headers["x-prefixgate-replica"]
    before = before.get(home, set())
    # the prompt's blocks, as the replica published them (the first one: the system prompt's head)
    ours = _wait("the prompt's blocks never reached the index",
                 lambda: {h for h, m in _entries(client, keys, home).items() if m == DEVICE} - before or None)
    # push them out of the pool (64 MiB, about 1,400 tokens): long prompts of the same session
    for i in range(12):
        filler = " ".join(f"{tag}-{i}-{j}" for j in range(100))  # about 1,200 tokens
        ask([{"role": "user", "content": f"Summarise: {filler}"}])
        held = _entries(client, keys, home)
        if any(held.get(h) == HOST for h in ours):
            break
    moved = _wait("no block of the prompt was published as held in the host tier",
                  lambda: {h for h, m in _entries(client, keys, home).items() if m == HOST} & ours)
    h = next(iter(moved))
    assert client.sismember(keys.block(h), member(home, HOST)) and not client.sismember(keys.block(h), home)
    # the same prefix again, from a new session: routed to the replica whose host tier has it,
    # once that replica's heartbeat (the load the router prices) shows the fillers gone
    def idle() -> bool:
        beat = client.hgetall(keys.heartbeat(home))
        return bool(beat) and all(int(beat.get(f, 0)) == 0 for f in ("running", "waiting", "pending_prefill_tokens"))

    _wait("the home replica's heartbeat never showed it idle", idle)
    again = ask(question[:1] + [{"role": "user", "content": "And on Sundays?"}], session=f"tiers-new-{tag}")
    assert again.headers["x-prefixgate-replica"] == home, (again.headers.get("x-prefixgate-route"), home)
    # the system prompt alone is 121 tokens: at least 7 full blocks, served from the host tier
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 7
    beat = _wait("the heartbeat never reported a measured host copy rate",
                 lambda: (b := client.hgetall(keys.heartbeat(home))) and int(b.get("kv_host_bytes_per_s", 0)) > 0 and b)
    assert int(beat["host_capacity_blocks"]) > 0
