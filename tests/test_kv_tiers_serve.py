"""The host tier in the real stack: a prefix pushed out of a replica's pool is
published as held in host memory, stays routed to that replica, and comes back as a cache hit."""

from __future__ import annotations

import uuid

import redis

from router.protocol.media import DEVICE, HOST, member, split_entry
from router.protocol.redis_schema import RedisKeys
from tests.helpers.stack import chat, decisions, wait_idle, wait_until

SYSTEM = ("You are the archivist of the Lighthouse Library. You answer questions about opening hours, "
          "loans, rare books and the reading room, briefly and precisely. ") * 4


def _entries(client: redis.Redis, keys: RedisKeys, rid: str) -> dict[int, str]:
    return dict(split_entry(e) for e in client.smembers(keys.blocks(rid)))


def _push_to_host(stack, client, keys, tag: str):
    """One request of a fresh prefix, then long prompts of the same session until a block of it is
    published as held in the host tier; returns (the system prompt, its replica, moved blocks)."""
    system = f"Archive {tag}. " + SYSTEM
    question = [{"role": "system", "content": system}, {"role": "user", "content": "When do you open?"}]
    before = {rid: set(_entries(client, keys, rid)) for rid in client.smembers(keys.replicas)}
    home = _ask(stack, question, f"tiers-{tag}").headers["x-prefixgate-replica"]
    before = before.get(home, set())
    # the prompt's blocks, as the replica published them (the first one: the system prompt's head)
    ours = wait_until("the prompt's blocks never reached the index",
                 lambda: {h for h, m in _entries(client, keys, home).items() if m == DEVICE} - before or None)
    # push them out of the pool (64 MiB, about 1,400 tokens): long prompts of the same session
    for i in range(12):
        filler = " ".join(f"{tag}-{i}-{j}" for j in range(100))  # about 1,200 tokens
        _ask(stack, [{"role": "user", "content": f"Summarise: {filler}"}], f"tiers-{tag}")
        held = _entries(client, keys, home)
        if any(held.get(h) == HOST for h in ours):
            break
    moved = wait_until("no block of the prompt was published as held in the host tier",
                  lambda: {h for h, m in _entries(client, keys, home).items() if m == HOST} & ours)
    return system, home, moved


def _ask(stack, messages, session):
    r = chat(stack, messages, session, max_tokens=4)
    assert r.status_code == 200, r.text
    return r


def test_prefix_evicted_to_host_is_published_routed_and_hit(stack):
    """The same prefix again, from a new session, goes to the replica whose host tier has it, when
    loads are equal. The router prices its own copy of the heartbeats, which may still show the
    fillers after Redis says idle; so the decision's inputs are read back from the live audit, and
    a try whose decision saw unequal loads is done again on a fresh prefix (three tries at most)."""
    keys = RedisKeys(stack.config.key_prefix)
    client = redis.Redis.from_url(stack.config.redis_url, decode_responses=True)
    tried = []
    for _ in range(3):
        system, home, moved = _push_to_host(stack, client, keys, uuid.uuid4().hex[:6])
        h = next(iter(moved))
        assert client.sismember(keys.block(h), member(home, HOST)) and not client.sismember(keys.block(h), home)
        wait_idle(stack, settled=True)
        before = len(decisions(stack))
        again = _ask(stack, [{"role": "system", "content": system}, {"role": "user", "content": "And on Sundays?"}],
                     f"tiers-new-{uuid.uuid4().hex[:6]}")
        mine = decisions(stack)[before:]
        assert len(mine) == 1, mine  # nothing else uses the stack meanwhile
        d = mine[0]
        tried.append((d.route.reason, d.loads, d.seen, d.costs))
        if any(any(load) for load in d.loads.values()):
            continue  # the router's copy still counted a filler
        assert again.headers["x-prefixgate-replica"] == home, (d, home)
        # the system prompt alone is 121 tokens: at least 7 full blocks, served from the host tier
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 7
        break
    else:
        raise AssertionError(f"the router never saw idle replicas in three tries: {tried}")
    beat = wait_until("the heartbeat never reported a measured host copy rate",
                 lambda: (b := client.hgetall(keys.heartbeat(home))) and int(b.get("kv_host_bytes_per_s", 0)) > 0 and b)
    assert int(beat["host_capacity_blocks"]) > 0
