"""Streaming clients for `prefixgate bench serving`, in a process of their own (as real clients
are): `streams` concurrent loops, each sending completions one after another with
`stream: true`, parsing every SSE event as JSON, counting output tokens from `usage`.

Prints one JSON object: per-request TTFT, events and completion tokens, and the wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import httpx


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    start = time.perf_counter()
    ttft = None
    events = tokens = 0
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"error": r.status_code, "body": r.text[:200]}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            choices = event.get("choices") or []
            if choices and choices[0].get("text"):
                events += 1
                if ttft is None:
                    ttft = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return {"ttft_s": ttft, "events": events, "tokens": tokens, "latency_s": time.perf_counter() - start}


async def run(base: str, model: str, streams: int, requests: int, max_tokens: int, prompt_words: int) -> dict:
    url = f"{base}/v1/completions"
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    results: list[dict] = []

    async def loop(s: int) -> None:
        for k in range(requests):
            prompt = f"stream {s} request {k}: " + " ".join(f"w{(s * 7 + k + i) % 97}" for i in range(prompt_words))
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                    "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
            results.append(await _one(client, url, body))

    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(loop(s) for s in range(streams)))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "results": results}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--base", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--streams", type=int, required=True)
    p.add_argument("--requests", type=int, default=2, help="per stream, one after another")
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--prompt-words", type=int, default=32)
    a = p.parse_args(argv)
    out = asyncio.run(run(a.base, a.model, a.streams, a.requests, a.max_tokens, a.prompt_words))
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
