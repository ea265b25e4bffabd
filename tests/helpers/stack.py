"""Talking to a running stack (the session's `stack` fixture, or a side app beside it): chat
requests, the replicas' heartbeats, a second Serve app, the three-turn session check."""

from __future__ import annotations

import contextlib
import time
import uuid

import httpx
import redis

from router.protocol.audit_log import Decision, read_dir
from router.protocol.redis_schema import RedisKeys

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are a patient geography tutor. Answer in one short sentence and name the country. " * 3


def chat(stack, messages, session=None, **kw):
    headers = {"x-session-id": session} if session else {}
    body = {"model": MODEL, "messages": messages, "max_tokens": 24, **kw}
    return httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers=headers, timeout=120)


def three_turn_session(stack) -> None:
    """Three turns of one session: the cache grows each turn and the session stays on its replica
    (tests/test_gateway_e2e.py on the session stack, tests/test_gateway_cluster.py on a cluster)."""
    session = f"s-{uuid.uuid4().hex[:6]}"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]
    replicas, cached, prompt = [], [], []
    for question in ["And of Germany?", "And of Italy?", None]:
        r = chat(stack, messages, session)
        assert r.status_code == 200, r.text
        body = r.json()
        replicas.append(r.headers["x-prefixgate-replica"])
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
        prompt.append(body["usage"]["prompt_tokens"])
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
        if question:
            messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                         {"role": "user", "content": question}]
    assert len(set(replicas)) == 1, replicas
    assert cached[1] > cached[0] and cached[2] > cached[1], cached
    assert cached[2] >= prompt[1] - 16 - 8  # the whole previous turn, up to its unfinished last block
    assert r.headers["x-prefixgate-route"] == "session"


def _replica_beats(stack) -> dict[str, dict]:
    """Each registered replica's heartbeat hash, by replica id."""
    client = redis.Redis.from_url(stack.config.redis_url, decode_responses=True)
    keys = RedisKeys(stack.config.key_prefix)
    beats = {rid: client.hgetall(keys.heartbeat(rid)) for rid in client.smembers(keys.replicas)}
    return {rid: hb for rid, hb in beats.items() if hb}  # a killed replica's id lingers until GC; its beat is gone


def _replica_loads(stack) -> list[dict]:
    return list(_replica_beats(stack).values())


def wait_until(what: str, check, timeout_s: float = 60.0):
    """Until `check()` returns something true, which is returned (replicas publish and beat
    asynchronously); the deadline only guards against a hang and names `what` never happened."""
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        if time.monotonic() > deadline:  # a hang guard, not a timing assertion
            raise TimeoutError(f"never happened: {what}")
        time.sleep(0.1)
    return value


def wait_idle(stack, timeout_s: float = 60, settled: bool = False) -> list[dict]:
    """Until every replica's heartbeat reports nothing running or waiting and no referenced block
    (the deadline only guards against a hang): routing and abort tests start from equal loads.
    `settled`: and then until every replica has written one more idle heartbeat, so a router's
    copy of the heartbeats (refreshed every 0.1 s) has very likely read an idle one too; a routing
    test still reads what its decision saw from the audit (`decisions`). A write shows as the
    key's TTL higher than at the previous reading (between writes it only falls)."""
    deadline = time.monotonic() + timeout_s
    client = redis.Redis.from_url(stack.config.redis_url)
    keys = RedisKeys(stack.config.key_prefix)
    ttl: dict[str, int] = {}  # each replica's heartbeat TTL at the previous reading, while idle
    wrote: set[str] = set()  # replicas seen writing an idle heartbeat since
    while True:
        beats = _replica_beats(stack)
        loads = list(beats.values())
        busy = [ld for ld in loads if int(ld.get("running", 0)) or int(ld.get("waiting", 0))]
        used = [int(ld["capacity_blocks"]) - int(ld["free_blocks"]) - int(ld["cached_blocks"]) for ld in loads]
        if not loads or busy or any(used):
            ttl, wrote = {}, set()
        elif not settled:
            return loads
        else:
            now = {rid: client.pttl(keys.heartbeat(rid)) for rid in beats}
            wrote |= {rid for rid, left in now.items() if rid in ttl and left > ttl[rid]}
            ttl = now
            if wrote >= set(beats):
                return loads
        if time.monotonic() > deadline:  # a hang guard, not a timing assertion
            raise TimeoutError(f"replicas stayed busy: {loads}")
        time.sleep(0.1 if ttl else 0.25)


def decisions(stack) -> list[Decision]:
    """Every routing decision the stack's routers recorded so far (the live audit the session
    stack writes, `audit_dir` in tests/conftest.py), in the order they were written."""
    return [r for r in read_dir(stack.config.audit_dir) if isinstance(r, Decision)]


@contextlib.contextmanager
def side_app(stack, name: str, config):
    """A second Serve app beside the session stack at /name, fresh (an app left by an earlier run
    is deleted first) and deleted on exit; yields its base URL."""
    from ray import serve

    if name in serve.status().applications:
        serve.delete(name)
    url = stack.deploy(config, name=name, route_prefix=f"/{name}")
    try:
        yield url
    finally:
        serve.delete(name)
