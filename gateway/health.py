"""Health that tells the present: liveness, readiness with named causes, and why a stack that
never became ready is not ready.

Readiness is computed from fresh state on every probe (states and what a load balancer should
probe: docs/reliability.md, "Health"): a failed Redis ping drops the pooled
connection and tries once more on a new one (a probe right after a Redis restart reconnects
instead of failing on the stale socket); a replica must answer `info`; and Serve's own view
(application and deployment status, their messages) names what is missing.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("prefixgate.health")


async def check_redis(gw) -> str | None:
    """None when Redis answers a ping; else the problem, naming the URL (password redacted)."""
    from router.index.redis_index import connect, redact

    url = gw.config.redis_url
    error: Exception | None = None
    for _ in range(2):  # the pooled connection may be stale (Redis restarted): reconnect once
        try:
            if gw._redis is None:
                gw._redis = connect(url, 1.0)
            await asyncio.wait_for(gw._redis.ping(), 1.0)
            return None
        except Exception as e:
            error = e
            stale, gw._redis = gw._redis, None
            if stale is not None:
                try:
                    await asyncio.wait_for(stale.aclose(), 0.5)
                except Exception:
                    pass
    return f"redis unreachable at {redact(url)}: {type(error).__name__}: {error}"


async def check_replicas(gw) -> dict[str, str | None]:
    """Per served model: None when one of its replicas answers, else why not."""
    async def ask(served) -> str | None:
        try:
            await asyncio.wait_for(served.replicas.info.remote(), 5.0)
            return None
        except Exception as e:
            return f"no replica of {served.name} answered: {type(e).__name__}: {e}"

    answers = await asyncio.gather(*(ask(s) for s in gw.served.values()))
    return dict(zip(gw.served, answers, strict=True))


def serve_problems(app_name: str | None = None) -> list[str]:
    """Serve's account of every application (or one) that is not RUNNING / HEALTHY: status,
    message, and replica states of each unhealthy deployment. Empty when all is well."""
    from ray import serve

    problems: list[str] = []
    for name, app in serve.status().applications.items():
        if app_name is not None and name != app_name:
            continue
        if str(app.status).rsplit(".", 1)[-1] != "RUNNING":
            problems.append(f"application {name!r}: {_status(app.status)}" + (f": {app.message}" if app.message else ""))
        for dep_name, dep in app.deployments.items():
            if _status(dep.status) != "HEALTHY":
                states = ", ".join(f"{_status(k)}={v}" for k, v in (dep.replica_states or {}).items())
                problems.append(
                    f"deployment {name}/{dep_name}: {_status(dep.status)}"
                    + (f" (replicas {states})" if states else "") + (f": {dep.message}" if dep.message else "")
                )
    return problems


def _status(value) -> str:
    return str(getattr(value, "value", value)).rsplit(".", 1)[-1]


async def readiness(gw, app_name: str | None = None) -> tuple[bool, dict]:
    """(ready, body) for /health. Ready means this gateway can serve: a replica answers. The
    cache index is a routing input, not a serving dependency: with Redis away every gateway
    still serves (its router decides from what it knows itself, `stale` decisions), so the
    probe stays 200 and says `degraded` with `routing: local`, instead of a fleet-wide 503
    that would take every gateway out of a load balancer at once (docs/reliability.md)."""
    checks: dict[str, str] = {}
    causes: list[str] = []
    if gw.config.redis_url:
        redis_problem = await check_redis(gw)
        checks["redis"] = "ok" if redis_problem is None else "unreachable"
        if redis_problem:
            causes.append(redis_problem)
    replica_problems = await check_replicas(gw)
    down = [problem for problem in replica_problems.values() if problem]
    checks["replicas"] = "ok" if not down else ("unavailable" if len(down) == len(replica_problems) else "degraded")
    causes += down
    try:
        serve_view = await asyncio.wait_for(asyncio.to_thread(serve_problems, app_name), 5.0)
    except Exception as e:  # the controller is busy or away: say so, do not fail on it alone
        serve_view = []
        checks["serve"] = f"unknown ({type(e).__name__})"
    else:
        checks["serve"] = "ok" if not serve_view else "degraded"
    causes += serve_view
    ready = checks["replicas"] != "unavailable"  # serves while one model's replica answers (a degraded deployment's too)
    status = "unavailable" if not ready else ("ok" if all(v == "ok" for v in checks.values()) else "degraded")
    routing = "index" if checks.get("redis", "ok") == "ok" else "local"
    body = {"status": status, "routing": routing, "checks": checks, "causes": causes}
    if len(gw.served) > 1:
        body["models"] = {name: "ok" if problem is None else "unavailable" for name, problem in replica_problems.items()}
    roles = {name: {"prefill": s.config.prefill_replicas, "decode": s.config.decode_replicas}
             for name, s in gw.served.items() if s.config.split}
    if roles:  # models with prefill and decode replicas of their own (docs/prefill-decode.md): the counts configured
        body["roles"] = roles
    body["queued"] = sum(s.flow.depth() for s in gw.served.values())  # waiting in this gateway's queues (gateway/flow/)
    limits = rate_limit_mode(gw, checks)
    if limits is not None:  # tenants with rpm/tpm: "shared" (Redis) or "local" (this gateway's share)
        body["rate_limits"] = limits
        problem = getattr(gw.limiter, "problem", None)
        if limits == "local" and problem and checks.get("redis") == "ok":
            causes.append(problem)
            body["status"] = "degraded"
    return ready, body


def rate_limit_mode(gw, checks: dict[str, str]) -> str | None:
    """How the tenants' rate limits hold now: "shared" through Redis by every gateway, "local"
    (each gateway its share: Redis away, as the index's `routing: local`); None: no limits."""
    keys = getattr(gw, "keys", None)
    limiter = getattr(gw, "limiter", None)
    if keys is None or limiter is None or not any(t.limited for t in keys.tenants.values()):
        return None
    if checks.get("redis", "unreachable") != "ok" or limiter.mode == "local":
        return "local"
    return "shared"
