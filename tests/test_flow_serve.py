"""Flow control on a live stack (simulated-compute replicas, real Serve, Redis, HTTP): a quiet
tenant's request goes ahead of a flood queued in the gateway, a tenant over its requests per
minute gets a 429 `rate_limit_exceeded` with OpenAI's headers, `service_tier` is echoed (and an
unknown one is a 400), and a queued request whose client left is dropped, never sent.

Every wait is on an event (the gateway's /health queue depth, responses, its /metrics), never
on elapsed time."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import AppConfig
from replica.default_model import DEFAULT_MODEL_NAME
from tests.helpers.stack import side_app

KEYS = {"sk-flood": "flood", "sk-quiet": {"tenant": "quiet"},
        "sk-limited": {"tenant": "limited", "rpm": 2, "tpm": 100_000}}
FLOOD = 12
SEATS = 4  # 2 replicas x max_ongoing_requests 2: the rest of the flood waits in the gateway


@pytest.fixture(scope="module")
def flow_app(stack):
    config = AppConfig(
        redis_url=stack.config.redis_url, key_prefix=f"flow-{uuid.uuid4().hex[:6]}", engine="sim", replicas=2,
        num_blocks=512, block_size=16, max_model_len=4096, max_ongoing_requests=2, max_num_seqs=4,
        max_queued_requests=32, api_keys=KEYS, redis_timeout_s=1.0, flow_control=True,
        sim_service={"decode_step_s": 0.04},  # a flood request decodes for a couple of seconds
    )
    with side_app(stack, "flowctl", config) as url:
        yield url


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _body(prompt: str, max_tokens: int, **kw) -> dict:
    return {"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "ignore_eos": True, **kw}


async def _until(cond, what: str, timeout_s: float = 120.0):
    """Poll an event until it holds; the deadline only guards against a hang."""
    deadline = time.monotonic() + timeout_s
    while not (value := await cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)
    return value


async def _queued(http: httpx.AsyncClient, url: str) -> int:
    return (await http.get(f"{url}/health")).json().get("queued", 0)


def _shed(url: str, reason: str) -> float:
    """Requests shed for `reason`, every tenant's (the counter carries model_name and tenant too)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "prefixgate_shed_requests":
            for s in family.samples:
                if s.name.endswith("_total") and s.labels.get("reason") == reason:
                    assert s.labels["model_name"] and s.labels["tenant"], s.labels
                    total += s.value
    return total


def test_a_quiet_tenant_goes_ahead_of_a_queued_flood(flow_app):
    url = flow_app
    events: list[tuple[str, int]] = []  # in the order they happened
    tiers: list[str] = []
    long_prompt = "Tell me everything about the history of railways in every country. " * 40

    async def flood_one(http: httpx.AsyncClient, i: int) -> None:
        body = _body(f"{i} {long_prompt}", 96, stream=True)  # about 4 s: the quiet request's way in
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body, headers=_auth("sk-flood")) as r:
            assert r.status_code == 200, await r.aread()
            events.append(("flood", i))  # its headers: its first token was produced
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"choices"' in line:
                    tiers.append(json.loads(line[6:])["service_tier"])

    async def run() -> tuple[int, int, dict]:
        async with httpx.AsyncClient(timeout=300) as http:
            flood = [asyncio.create_task(flood_one(http, i)) for i in range(FLOOD)]
            queued = await _until(lambda: _queued_at_least(http, url, FLOOD - SEATS - 2), "the flood to queue")
            issued_at = len(events)
            r = await http.post(f"{url}/v1/chat/completions", json=_body("Hi!", 2, service_tier="auto"),
                                headers=_auth("sk-quiet"))
            assert r.status_code == 200, r.text
            events.append(("quiet", 0))
            await asyncio.gather(*flood)
            return queued, issued_at, r.json()

    queued, issued_at, quiet = asyncio.run(run())
    after = events[issued_at:]
    flood_started_meanwhile = [e for e in after[: after.index(("quiet", 0))] if e[0] == "flood"]
    # FIFO would have started every queued flood request first (`queued` of them, besides those
    # already on a replica); here the quiet tenant's request goes at once (a tenant with nothing
    # in flight has a seat held for it) or at the next free seat: before it, at most the flood
    # requests already sent (SEATS) and one sent as it arrived
    assert len(flood_started_meanwhile) <= SEATS + 1 < queued, (flood_started_meanwhile, queued, events)
    assert quiet["service_tier"] == "default"  # auto is served (and echoed) as default
    assert tiers and set(tiers) == {"default"}  # in every stream chunk too
    assert sorted(i for kind, i in events if kind == "flood") == list(range(FLOOD))  # the whole flood served


async def _queued_at_least(http: httpx.AsyncClient, url: str, n: int, at_most: int | None = None) -> int | bool:
    q = await _queued(http, url)
    return (q or True) if n <= q and (at_most is None or q <= at_most) else False


def test_a_tenant_over_its_requests_per_minute_gets_429_with_openai_headers(flow_app):
    url = flow_app
    answers = [httpx.post(f"{url}/v1/chat/completions", json=_body("One more question.", 2), timeout=120,
                          headers=_auth("sk-limited")) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429], [a.text for a in answers]
    for a, left in zip(answers, ("1", "0", "0"), strict=True):
        assert a.headers["x-ratelimit-limit-requests"] == "2"
        assert a.headers["x-ratelimit-remaining-requests"] == left
        assert a.headers["x-ratelimit-reset-requests"].endswith("s")
        assert a.headers["x-ratelimit-limit-tokens"] == "100000" and "x-ratelimit-remaining-tokens" in a.headers
    error = answers[2].json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests", error
    assert int(answers[2].headers["retry-after"]) >= 1
    # other tenants are not limited, and get no limit headers
    r = httpx.post(f"{url}/v1/chat/completions", json=_body("Hello.", 2), headers=_auth("sk-quiet"), timeout=120)
    assert r.status_code == 200 and "x-ratelimit-limit-requests" not in r.headers
    # an unknown service tier is OpenAI's 400
    r = httpx.post(f"{url}/v1/chat/completions", json=_body("Hello.", 2, service_tier="gold"), headers=_auth("sk-quiet"),
                   timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "service_tier", r.text


def test_a_queued_request_whose_client_left_is_dropped(flow_app):
    url = flow_app
    prompt = "Describe the weather on every continent in detail. " * 20

    async def run() -> None:
        async with httpx.AsyncClient(timeout=300) as http:
            async def busy(i: int) -> None:  # long enough that no seat frees during the test
                await http.post(f"{url}/v1/chat/completions", json=_body(f"{i} {prompt}", 2000), headers=_auth("sk-flood"))

            flood = [asyncio.create_task(busy(i)) for i in range(SEATS + 2)]
            try:
                await _until(lambda: _queued_at_least(http, url, 2), "requests to queue")
                before = await asyncio.to_thread(_shed, url, "disconnected")
                # the flood's own (a tenant with nothing in flight would take the seat held for it)
                leaver = asyncio.create_task(http.post(f"{url}/v1/chat/completions", json=_body("Still there?", 2),
                                                       headers=_auth("sk-flood")))
                await _until(lambda: _queued_at_least(http, url, 3), "the leaver to queue")
                leaver.cancel()  # the client goes away while its request waits
                await _until(lambda: _more(url, "disconnected", before), "the gateway to drop the request")
                assert await _queued(http, url) == 2  # the flood's queued requests are still there
            finally:
                for task in flood:  # these clients leave too: Serve cancels their requests
                    task.cancel()
                await asyncio.gather(*flood, return_exceptions=True)
        async with httpx.AsyncClient(timeout=60) as http:
            await _until(lambda: _queued_at_least(http, url, 0, at_most=0), "the queue to empty once every client left")

    asyncio.run(run())


async def _more(url: str, reason: str, before: float) -> bool:
    return await asyncio.to_thread(_shed, url, reason) > before


def test_overload_completes_or_refuses_before_the_first_byte(flow_app):
    """`prefixgate bench overload`'s open loop, at many times what the flow app's 4 seats serve:
    every request completes (all its tokens, usage included) or is refused with a 429 before its
    first byte; none fails otherwise, the queue's worth of requests completes, and some are shed."""
    from loadtest.bench import overload

    args = overload.parse_args(["--prompt", "48", "--max-tokens", "8", "--seed", "3"])
    out = asyncio.run(overload.open_loop(f"{flow_app}/v1/completions", DEFAULT_MODEL_NAME, rate=60.0, seconds=1.0,
                                         args=args, key="sk-quiet"))
    assert out.failed == {}, out
    assert out.completed + out.refused_429 == out.total and out.total >= 50, out
    assert out.completed >= 32 + SEATS and out.refused_429 > 0, out  # the queue's 32 and the seats ran; the rest shed
