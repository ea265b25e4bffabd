"""Open-loop trace replay over HTTP: every request is sent at its own (scaled) arrival time,
whether or not earlier ones have answered, as real clients do.

One asyncio task per request on one httpx client, so thousands can be in flight from one
process without threads; a late send (the client itself behind) is recorded as `send_lag_s`.
Each request is a streaming `/v1/completions` call with the prompt as token ids, so the replay
needs no tokenizer and rows sharing leading hash ids share leading tokens exactly.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

from router.sim.trace import prompt_tokens
from router.sim.workload import SimRequest


@dataclass
class ReplaySettings:
    url: str = "http://127.0.0.1:8000"
    block_size: int = 16
    arrival_scale: float = 1.0  # trace seconds are divided by this to get wall seconds
    seed: int = 0
    request_timeout_s: float = 600.0
    drain_s: float = 120.0  # after the last send, requests still unanswered are cut off (errors)
    progress_s: float = 30.0  # print sent/answered/failed this often (0: never)
    model: str | None = None  # default: the gateway's first /v1/models entry
    adapter_names: dict[str, str] = field(default_factory=dict)  # a request's adapter identity -> its served name


@dataclass
class ReplayRecord:
    index: int
    at_s: float  # scheduled send time, wall seconds from the start
    send_lag_s: float = 0.0  # how late the client actually sent it
    status: int | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None  # wall seconds from send to the first streamed chunk
    latency_s: float | None = None
    replica: str | None = None
    route: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        return d


async def _one(client: httpx.AsyncClient, s: ReplaySettings, model: str, req: SimRequest, index: int,
               rec: ReplayRecord, t_start: float) -> None:
    delay = t_start + rec.at_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    t0 = time.perf_counter()
    rec.send_lag_s = max(0.0, t0 - t_start - rec.at_s)
    payload = {"model": s.adapter_names[req.adapter] if req.adapter else model, "prompt": prompt_tokens(req, index, s.block_size, s.seed),
               "max_tokens": req.output_tokens, "temperature": 0, "stream": True,
               "stream_options": {"include_usage": True}}
    usage = None
    done = False
    try:
        async with client.stream("POST", f"{s.url}/v1/completions", json=payload) as resp:
            rec.status = resp.status_code
            rec.replica = resp.headers.get("x-prefixgate-replica")
            rec.route = resp.headers.get("x-prefixgate-route")
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {body[:200]}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        rec.error = f"stream error: {obj['error']}"[:200]
                        break
                    if obj.get("choices") and rec.ttft_s is None:
                        rec.ttft_s = time.perf_counter() - t0
                    if obj.get("usage"):
                        usage = obj["usage"]
                if rec.error is None and not done:
                    rec.error = "stream ended without [DONE]"
                elif rec.error is None and usage is None:
                    rec.error = "no usage in stream"
    except (httpx.HTTPError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:200]
    rec.latency_s = time.perf_counter() - t0
    if usage is not None:
        rec.prompt_tokens = usage.get("prompt_tokens", 0)
        rec.completion_tokens = usage.get("completion_tokens", 0)
        rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


async def _progress(records: list[ReplayRecord], t_start: float, every_s: float) -> None:
    """A line every `every_s`: how far the replay is, so a slow or stuck run shows itself."""
    while True:
        await asyncio.sleep(every_s)
        now = time.perf_counter() - t_start
        due = sum(1 for r in records if r.at_s <= now)
        done = sum(1 for r in records if r.latency_s is not None)
        failed = sum(1 for r in records if r.error is not None)
        print(f"[replay] {now:.0f}s: {due}/{len(records)} due, {done} answered, {failed} failed, "
              f"{due - done} in flight", file=sys.stderr, flush=True)


def model_name(url: str) -> str:
    r = httpx.get(f"{url}/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def replay_async(requests: list[SimRequest], s: ReplaySettings) -> list[ReplayRecord]:
    """Sends every request at arrival / arrival_scale after the start; returns one record each,
    in request order, once all have answered (or failed, or timed out)."""
    model = s.model or model_name(s.url)
    records = [ReplayRecord(i, r.arrival / s.arrival_scale) for i, r in enumerate(requests)]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(s.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t_start = time.perf_counter()
        tasks = [asyncio.create_task(_one(client, s, model, r, i, records[i], t_start)) for i, r in enumerate(requests)]
        last = max((rec.at_s for rec in records), default=0.0)
        watch = asyncio.create_task(_progress(records, t_start, s.progress_s)) if s.progress_s > 0 else None
        _, pending = await asyncio.wait(tasks, timeout=last + s.drain_s) if tasks else (set(), set())
        if watch is not None:
            watch.cancel()
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for rec in records:
        if rec.error is None and rec.latency_s is None:
            rec.error = f"cut off: no answer {s.drain_s:.0f}s after the last send"
    return records


def replay(requests: list[SimRequest], s: ReplaySettings) -> list[ReplayRecord]:
    return asyncio.run(replay_async(requests, s))
