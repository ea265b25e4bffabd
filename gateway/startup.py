"""Why a stack did not become ready: what `prefixgate serve` (and LocalStack) report when the
gateway does not answer healthy in time, instead of a bare timeout."""

from __future__ import annotations

import redis


class StackNotReady(TimeoutError):
    """The app did not become healthy in time; the message names what is not ready and why."""


def not_ready_report(timeout_s: float, last_answer: str | None, config, app_name: str | None = None) -> str:
    from gateway.health import serve_problems
    from router.index.redis_index import redact

    lines = [f"the app {app_name or ''!r} was not ready (waited up to {timeout_s:.0f}s)"]
    if last_answer:
        lines.append(f"last answer from the gateway: {last_answer[:2000]}")
    try:
        problems = serve_problems(app_name)
    except Exception as e:  # the Serve controller itself is not there
        problems = [f"Serve status unavailable: {type(e).__name__}: {e}"]
    lines += problems or ["Serve reports every application RUNNING and every deployment HEALTHY"]
    if config.redis_url:
        try:
            redis.Redis.from_url(config.redis_url, socket_timeout=2, socket_connect_timeout=2).ping()
            lines.append(f"redis at {redact(config.redis_url)}: ok")
        except Exception as e:
            lines.append(f"redis at {redact(config.redis_url)}: unreachable ({type(e).__name__}: {e})")
    return "\n  ".join(lines)
