"""Per-tenant rate limits against a real redis-server: RATE_LIMIT_SCRIPT (one atomic call per
admission) shared by several gateways, both buckets taken or neither, OpenAI's headers, and a
gateway's local share when Redis is away (reported as /health reports it)."""

from __future__ import annotations

import asyncio
import socket
import uuid

import redis

from gateway.flow.keys import TenantSpec
from gateway.flow.rate_limit import RateLimiter
from gateway.health import rate_limit_mode
from gateway.local_redis import LocalRedis, free_port
from router.protocol.redis_schema import RedisKeys


def _keys() -> RedisKeys:
    return RedisKeys(f"rl-{uuid.uuid4().hex[:6]}")


def _tenant(**limits) -> TenantSpec:
    return TenantSpec(f"tenant-{uuid.uuid4().hex[:6]}", **limits)


class ManualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock moves only when the test moves it (`advance`): a budget
    (asyncio.wait_for's, redis-py's) runs out when the test says so, never because the machine
    was busy, and a test never sleeps to let one run out. I/O goes on as usual."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def time(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _on_manual_clock(main):
    with asyncio.Runner(loop_factory=ManualClockLoop) as runner:
        return runner.run(main())


def _held_connections(monkeypatch):
    """The limiter's connections wait at open_client until `release` is set; `entered` is set
    when the first one gets there."""
    import router.index.redis_index as redis_index

    real = redis_index.open_client
    gate = {}

    async def held(url, timeout_s):
        gate["entered"].set()
        await gate["release"].wait()
        return await real(url, timeout_s)

    monkeypatch.setattr(redis_index, "open_client", held)

    def events():  # created on the test's loop
        gate["entered"], gate["release"] = asyncio.Event(), asyncio.Event()
        return gate["entered"], gate["release"]

    return events


def test_requests_per_minute_fleet_wide(redis_server):
    keys, tenant = _keys(), _tenant(rpm=3)

    async def run():
        gateways = [RateLimiter(redis_server.url, keys, share=0.5), RateLimiter(redis_server.url, keys, share=0.5)]
        verdicts = [await gateways[i % 2].admit(tenant, 10) for i in range(4)]  # alternating gateways
        for g in gateways:
            await g.close()
        return verdicts, gateways

    verdicts, gateways = asyncio.run(run())
    assert [v.allowed for v in verdicts] == [True, True, True, False]  # 3 per minute for both together
    assert [v.headers["x-ratelimit-remaining-requests"] for v in verdicts] == ["2", "1", "0", "0"]
    assert all(v.headers["x-ratelimit-limit-requests"] == "3" for v in verdicts)
    assert "x-ratelimit-limit-tokens" not in verdicts[0].headers  # no tpm set
    refused = verdicts[3]
    assert refused.refused_by == "requests" and 0 < refused.retry_after_ms <= 20_000  # one request refills in 20 s
    assert all(g.mode == "shared" for g in gateways)
    req, tok = keys.rate_limit(tenant.name)
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    assert 0 < client.pttl(req) <= 61_000 and not client.exists(tok)  # a bucket key expires once full again


def test_both_buckets_or_neither(redis_server):
    keys, tenant = _keys(), _tenant(rpm=100, tpm=1000)

    async def run():
        limiter = RateLimiter(redis_server.url, keys)
        out = [await limiter.admit(tenant, 600), await limiter.admit(tenant, 600), await limiter.admit(tenant, 300),
               await limiter.admit(tenant, 5000)]
        await limiter.close()
        return out

    first, too_many, fits, never = asyncio.run(run())
    assert first.allowed and first.headers["x-ratelimit-remaining-tokens"] == "400"
    assert first.headers["x-ratelimit-reset-tokens"] in ("36s", "35.999s")  # 600 of 1000/min
    assert not too_many.allowed and too_many.refused_by == "tokens" and too_many.retry_after_ms > 0
    # the refused request took nothing: not its request either
    assert too_many.headers["x-ratelimit-remaining-requests"] == "99"
    assert fits.allowed and fits.headers["x-ratelimit-remaining-requests"] == "98"
    assert not never.allowed and never.retry_after_ms == -1  # more than the limit: waiting never helps


def test_concurrent_admissions_from_two_gateways_never_overshoot(redis_server):
    keys, tenant = _keys(), _tenant(rpm=20)

    async def run():
        gateways = [RateLimiter(redis_server.url, keys, timeout_s=5.0) for _ in range(2)]
        verdicts = await asyncio.gather(*(gateways[i % 2].admit(tenant, 1) for i in range(50)))
        for g in gateways:
            await g.close()
        return verdicts

    verdicts = asyncio.run(run())
    assert sum(v.allowed for v in verdicts) == 20


def test_a_first_connection_slower_than_an_admissions_budget_is_waited_for(redis_server, monkeypatch):
    """Right after start-up an admission waits for the limiter's first connection (topology
    detection, the script's load) instead of answering with the local share when connecting
    takes longer than one admission's budget: tests/test_flow_gateways.py, on a busy machine,
    saw a gateway's share (RPM / 2) where the shared limit belonged, from a healthy Redis."""
    events = _held_connections(monkeypatch)
    tenant = _tenant(rpm=10)

    async def run():
        entered, release = events()
        limiter = RateLimiter(redis_server.url, _keys(), share=0.5)
        first = asyncio.ensure_future(limiter.admit(tenant, 1))
        await entered.wait()  # connecting
        asyncio.get_running_loop().advance(4 * limiter.timeout_s)  # past an admission's budget, within a connection's
        release.set()
        verdict = await first
        await limiter.close()
        return limiter, verdict

    limiter, verdict = _on_manual_clock(run)
    assert verdict.allowed and verdict.headers["x-ratelimit-limit-requests"] == "10"  # shared, not 5
    assert limiter.mode == "shared" and limiter.problem is None


def test_concurrent_first_admissions_share_one_connection():
    """A burst at start-up: every admission waits for the same one connection attempt (one
    topology detection, one script load), none opens its own, and all take from the shared
    bucket. The budgets are hang guards here (the test above is about them)."""
    server = LocalRedis().start()  # a private server: its command counts are this test's
    try:
        tenant = _tenant(rpm=20)

        async def run():
            limiter = RateLimiter(server.url, _keys(), share=0.5, timeout_s=60)
            verdicts = await asyncio.gather(*(limiter.admit(tenant, 1) for _ in range(50)))
            await limiter.close()
            return limiter, verdicts

        limiter, verdicts = asyncio.run(run())
        stats = redis.Redis.from_url(server.url).info("commandstats")
    finally:
        server.cleanup()
    assert stats["cmdstat_info"]["calls"] == 1 and stats["cmdstat_script|load"]["calls"] == 1, stats
    assert all(v.headers["x-ratelimit-limit-requests"] == "20" for v in verdicts)
    assert sum(v.allowed for v in verdicts) == 20 and limiter.mode == "shared"


def test_a_redis_that_never_answers_at_start_up_still_means_the_local_share():
    """The fault path of the first connection: a Redis that accepts connections and never
    answers costs the first admissions the connection's budget, then this gateway enforces its
    share as designed (a refused connection fails at once: the test below)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    silent.setblocking(False)
    tenant = _tenant(rpm=10)

    async def run():
        limiter = RateLimiter(f"redis://127.0.0.1:{silent.getsockname()[1]}/0", _keys(), share=0.5,
                              connect_timeout_s=2.0)
        first = asyncio.ensure_future(limiter.admit(tenant, 1))
        loop = asyncio.get_running_loop()
        conn, _ = await loop.sock_accept(silent)  # the connection attempt is under way (and never answered)
        loop.advance(2.0)  # the connection's budget runs out
        verdict = await first
        await limiter.close()
        conn.close()
        return limiter, verdict

    try:
        limiter, verdict = _on_manual_clock(run)
    finally:
        silent.close()
    assert verdict.allowed and verdict.headers["x-ratelimit-limit-requests"] == "5"  # this gateway's share
    assert limiter.mode == "local" and "TimeoutError" in limiter.problem


def test_redis_away_means_a_local_share_reported_in_health(redis_server):
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    tenant = _tenant(rpm=10, tpm=100_000)

    async def run():
        limiter = RateLimiter(dead, _keys(), share=0.5, timeout_s=0.5, cooldown_s=60)
        verdicts = [await limiter.admit(tenant, 100) for _ in range(6)]
        await limiter.close()
        return limiter, verdicts

    limiter, verdicts = asyncio.run(run())
    assert [v.allowed for v in verdicts] == [True] * 5 + [False]  # half of 10 per minute: two gateways
    assert verdicts[0].headers["x-ratelimit-limit-requests"] == "5"  # the limit as this gateway enforces it
    assert limiter.mode == "local" and "redis unavailable" in limiter.problem

    class Gateway:  # what /health reads (gateway/health.py)
        pass

    from gateway.flow.keys import KeySpec, KeyTable

    gw = Gateway()
    gw.limiter = limiter
    gw.keys = KeyTable({"k": KeySpec(tenant=tenant.name)}, {tenant.name: tenant})
    assert rate_limit_mode(gw, {"redis": "ok"}) == "local"
    assert rate_limit_mode(gw, {"redis": "unreachable"}) == "local"
    gw.limiter = RateLimiter(redis_server.url, _keys())
    assert rate_limit_mode(gw, {"redis": "ok"}) == "shared"
    gw.keys = KeyTable({"k": KeySpec(tenant="free")}, {"free": TenantSpec("free")})
    assert rate_limit_mode(gw, {"redis": "ok"}) is None  # no tenant has limits: nothing to report


def test_bucket_keys_share_one_hash_tag():
    keys = RedisKeys("p")
    req, tok = keys.rate_limit("we{ir}d tenant")
    tag = req[: req.index("}") + 1]
    assert tok.startswith(tag) and tag.startswith("{p:rl:") and "ir" not in tag
