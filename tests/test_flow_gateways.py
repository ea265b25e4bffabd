"""Two gateways behind Serve's proxy (`gateways: 2`), live: real Ray Serve, real Redis, sim
replicas. A tenant's requests-per-minute limit holds for the fleet, not per gateway (one bucket
in Redis, taken by one script per admission), and each gateway shares its tenants' seats in the
model's flow-seats hash under the id its responses name (`x-prefixgate-gateway`)."""

from __future__ import annotations

import math
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import pytest
import redis

from gateway.config import AppConfig
from replica.default_model import DEFAULT_MODEL_NAME
from router.protocol.redis_schema import FlowSeats, RedisKeys
from tests.helpers.stack import side_app

pytestmark = pytest.mark.slow
RPM = 20
REQUESTS = 50  # well past the limit: each gateway alone would admit up to RPM of them
MAX_REQUESTS = 400  # a hang guard: Serve's proxy sending none to one gateway for this long is a failure
KEYS = {"sk-limited": {"tenant": "limited", "rpm": RPM, "tpm": 1_000_000}}


@pytest.fixture(scope="module")
def two_gateways(stack):
    config = AppConfig(
        redis_url=stack.config.redis_url, key_prefix=f"gw2-{uuid.uuid4().hex[:6]}", engine="sim", replicas=1,
        gateways=2, num_blocks=256, block_size=16, max_model_len=2048, api_keys=KEYS, redis_timeout_s=1.0,
    )
    with side_app(stack, "twogw", config) as url:
        yield url, config


def _ask(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120, headers={"authorization": "Bearer sk-limited"},
                      json={"model": DEFAULT_MODEL_NAME, "prompt": "Count: one two", "max_tokens": 1})


def test_a_requests_per_minute_limit_holds_across_two_gateways(two_gateways):
    url, config = two_gateways
    start = time.monotonic()
    answers: list[httpx.Response] = []
    with ThreadPoolExecutor(8) as pool:  # concurrent, so Serve's proxy spreads them over both gateways
        # Serve's proxy may send a burst to one gateway (the other busy on a loaded machine): go on
        # in bursts until each gateway has refused some, so both took from the one bucket
        while len(answers) < REQUESTS or len({a.headers["x-prefixgate-gateway"] for a in answers if a.status_code == 429}) < 2:
            assert len(answers) < MAX_REQUESTS, {a.headers.get("x-prefixgate-gateway") for a in answers}
            answers += pool.map(lambda _: _ask(url), range(8))
    elapsed_s = time.monotonic() - start
    assert {a.status_code for a in answers} <= {200, 429}, [a.text for a in answers if a.status_code not in (200, 429)]
    admitted = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 429]
    assert all(a.json()["error"]["code"] == "rate_limit_exceeded" for a in refused)
    assert all(a.headers["x-ratelimit-limit-requests"] == str(RPM) for a in answers)  # shared, not a local share
    # the bucket starts full (RPM) and refills RPM per minute while the run lasts; two gateways
    # each keeping its own bucket would admit up to 2 x RPM
    print(f"admitted {len(admitted)} of {len(answers)} at rpm {RPM} in {elapsed_s:.1f} s, by gateway:",
          {g: sum(a.headers["x-prefixgate-gateway"] == g for a in admitted) for g in {a.headers["x-prefixgate-gateway"] for a in answers}})
    assert RPM <= len(admitted) <= RPM + math.ceil(elapsed_s * RPM / 60), (len(admitted), elapsed_s)

    # each gateway writes its tenants' seats under the id its responses carry
    key = RedisKeys(config.model_configs()[0].key_prefix).flow_seats
    client = redis.Redis.from_url(config.redis_url)
    ids = {a.headers["x-prefixgate-gateway"] for a in answers}
    deadline = time.monotonic() + 60  # a hang guard only: the readers write every load_refresh_s
    while not ids <= {k.decode() for k in client.hkeys(key)}:
        assert time.monotonic() < deadline, (ids, client.hkeys(key))
        time.sleep(0.1)
    for raw in client.hmget(key, *sorted(ids)):
        entry = msgspec.json.decode(raw, type=FlowSeats)  # the contract's type
        assert entry.anonymous == 0 and set(entry.seats) <= {"limited"}, entry  # every request had the key
