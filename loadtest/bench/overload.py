"""Overload: several times what the replicas serve, offered open-loop, against a local stack with
flow control on (the default). Every request must either complete or be refused with a 429
before its first byte (never a 5xx, a broken stream or a hang), and the completed requests'
time to first token stays bounded by the tier's maximum wait in the gateway's queue:

    TTFT p99 (completed, overloaded) <= queue_wait_default_s + 2 x TTFT p99 (unloaded)

Three phases, one stack: `unloaded` (one client, one request at a time), `capacity` (a closed
loop of `--capacity-clients` clients: completed requests per second is what the replicas
serve), then `overload`: Poisson arrivals at `--factor` x that rate for `--duration` seconds,
each request streamed, and every request waited on to its end.

    prefixgate bench overload --duration 30 --queue-wait-s 5 --json /tmp/overload.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

from gateway.config import AppConfig
from gateway.stack import LocalStack
from loadtest.bench.noisy_neighbour import completion_body, stream_completion
from loadtest.bench.stack_options import add_config_option, add_ingress_option, config_overrides
from loadtest.summary import percentile
from replica.backends.engines import engine_spec


@dataclass
class Outcomes:
    """What happened to each request of a phase."""

    ttft_s: list[float] = field(default_factory=list)  # completed requests' time to first token
    completed: int = 0
    refused_429: int = 0  # a 429 before any byte of the body
    failed: dict[str, int] = field(default_factory=dict)  # anything else, by what it was
    seconds: float = 0.0

    def fail(self, what: str) -> None:
        self.failed[what] = self.failed.get(what, 0) + 1

    @property
    def total(self) -> int:
        return self.completed + self.refused_429 + sum(self.failed.values())


async def _one(http: httpx.AsyncClient, url: str, body: dict, out: Outcomes, key: str) -> None:
    try:
        ttft, tokens, code = await stream_completion(http, url, key, body)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out.fail(type(e).__name__)
        return
    if code is not None:
        if code in ("server_overloaded", "429", "rate_limit_exceeded"):
            out.refused_429 += 1
        else:
            out.fail(code)
    elif ttft is None or tokens != body["max_tokens"]:
        out.fail("incomplete")  # a 200 whose stream ended before its tokens and usage
    else:
        out.completed += 1
        out.ttft_s.append(ttft)


async def closed_loop(url: str, model: str, clients: int, seconds: float, args: argparse.Namespace,
                      key: str = "none") -> Outcomes:
    """`clients` clients, each sending its next request when the last ended, for `seconds`."""
    out = Outcomes(seconds=seconds)
    rng = random.Random(args.seed)
    end = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        async def client() -> None:
            while time.perf_counter() < end:
                await _one(http, url, completion_body(model, args.prompt, args.max_tokens, rng), out, key)

        await asyncio.gather(*(client() for _ in range(clients)))
    return out


async def open_loop(url: str, model: str, rate: float, seconds: float, args: argparse.Namespace,
                    key: str = "none") -> Outcomes:
    """Poisson arrivals at `rate` per second for `seconds`; waits for every request's end."""
    out = Outcomes(seconds=seconds)
    rng = random.Random(args.seed + 1)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        tasks: list[asyncio.Task] = []
        start = time.perf_counter()
        due = start
        while due < start + seconds:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            body = completion_body(model, args.prompt, args.max_tokens, rng)
            tasks.append(asyncio.create_task(_one(http, url, body, out, key)))
            due += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return out


@dataclass
class Report:
    capacity_rps: float
    offered_rps: float
    unloaded_p99_ms: float
    overloaded_p99_ms: float
    bound_ms: float  # queue_wait_default_s + 2 x unloaded p99
    requests: int
    completed: int
    refused_429: int
    failed: dict[str, int]

    @property
    def met(self) -> bool:
        return not self.failed and self.overloaded_p99_ms <= self.bound_ms


def format_report(r: Report) -> str:
    return "\n".join([
        f"capacity {r.capacity_rps:.2f} req/s; offered {r.offered_rps:.2f} req/s ({r.offered_rps / r.capacity_rps:.1f}x)",
        f"requests {r.requests}: completed {r.completed}, 429 before the first byte {r.refused_429}, "
        f"anything else {sum(r.failed.values())} {r.failed or ''}",
        f"TTFT p99: unloaded {r.unloaded_p99_ms:.0f} ms, completed under overload {r.overloaded_p99_ms:.0f} ms, "
        f"bound {r.bound_ms:.0f} ms (max wait + 2x unloaded): {'met' if r.met else 'MISSED'}",
    ])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="prefixgate bench overload", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="sim", choices=("sim", "model"))
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--duration", type=float, default=30.0, help="seconds of the capacity and overload phases")
    p.add_argument("--factor", type=float, default=3.0, help="offered load, times the measured capacity")
    p.add_argument("--capacity-clients", type=int, default=64, help="closed-loop clients that measure the capacity")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens per request (random: no cache hits)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--queue-wait-s", type=float, default=5.0, help="the stack's queue_wait_default_s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8125)
    add_config_option(p, "max_queued_requests=128")
    add_ingress_option(p)
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = config_overrides(args)
    # a Redis of its own ('auto'): AppConfig's default names a deployment's, and a stack
    # without one routes every request `stale` and runs flow control without heartbeats
    config = dict(engine=args.engine, replicas=args.replicas, max_model_len=4096, queue_wait_default_s=args.queue_wait_s,
                  **{"redis_url": "auto", **overrides})
    if engine_spec(args.engine).default_num_blocks is not None:  # a pool of blocks, not of a model's memory (sim)
        config.setdefault("num_blocks", 4096)
    stack = LocalStack(AppConfig(**config), port=args.port, ingress=args.ingress)
    try:
        stack.start()
        model = httpx.get(f"{stack.url}/v1/models", timeout=10).json()["data"][0]["id"]
        url = f"{stack.url}/v1/completions"
        asyncio.run(closed_loop(url, model, 2, 3.0, args))  # warm-up
        unloaded = asyncio.run(closed_loop(url, model, 1, max(args.duration / 2, 5.0), args))
        capacity = asyncio.run(closed_loop(url, model, args.capacity_clients, args.duration, args))
        rps = capacity.completed / capacity.seconds
        time.sleep(2.0)  # the capacity phase's last requests leave the replicas
        over = asyncio.run(open_loop(url, model, args.factor * rps, args.duration, args))
    finally:
        stack.stop()
    unloaded_p99 = (percentile(unloaded.ttft_s, 99) or 0.0) * 1000
    report = Report(
        capacity_rps=rps, offered_rps=over.total / over.seconds, unloaded_p99_ms=unloaded_p99,
        overloaded_p99_ms=(percentile(over.ttft_s, 99) or 0.0) * 1000, bound_ms=args.queue_wait_s * 1000 + 2 * unloaded_p99,
        requests=over.total, completed=over.completed, refused_429=over.refused_429, failed=over.failed,
    )
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**asdict(report), "met": report.met}, fh, indent=1)
    return 0 if report.met else 1


if __name__ == "__main__":
    sys.exit(main())
