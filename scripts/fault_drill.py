"""The long fault drill of docs/reliability.md (the CI test is its short form).

Brings up the real stack (2 replicas of the default model, Redis, Ray Serve), runs a mixed
load of greedy chat sessions (half streaming, half not) once undisturbed and once while a
replica is SIGKILLed twice (`--kill-gap-s` apart) and Redis is stopped for `--redis-outage-s`,
then compares: failed requests, malformed streams, greedy answers that differ from the
undisturbed run (with the top-2 logprob gap at the first differing token: a near-tie below
1e-4 is rounding, anything else a bug), and each migration's recompute cost.

    flock /tmp/prefixgate-heavy.lock .venv/bin/python scripts/fault_drill.py --out drill.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import httpx
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.config import AppConfig  # noqa: E402
from gateway.local_redis import LocalRedis, free_port  # noqa: E402
from gateway.stack import LocalStack  # noqa: E402
from router.protocol.redis_schema import RedisKeys  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["the sea", "a storm", "a lighthouse", "a harbour town", "a long voyage", "the tides", "whales", "a shipwreck"]


def _body(session: int, turn: int, stream: bool, max_tokens: int) -> dict:
    topic = TOPICS[(session * 3 + turn) % len(TOPICS)]
    return {"model": MODEL, "temperature": 0, "max_tokens": max_tokens, "stream": stream,
            "logprobs": True, "top_logprobs": 2, "stream_options": {"include_usage": True} if stream else None,
            "messages": [{"role": "user", "content": f"Session {session}, turn {turn}: describe {topic} in detail."}]}


async def _one(http: httpx.AsyncClient, url: str, body: dict, session: str) -> dict:
    out = {"ok": False, "text": "", "tokens": [], "top": [], "usage": None, "finish": [], "done": 0, "errors": [],
           "migrations": [], "status": None}
    body = {k: v for k, v in body.items() if v is not None}
    headers = {"x-session-id": session}
    try:
        if not body["stream"]:
            r = await http.post(f"{url}/v1/chat/completions", json=body, headers=headers)
            out["status"] = r.status_code
            if r.status_code != 200:
                out["errors"].append(r.text[:300])
                return out
            data = r.json()
            choice = data["choices"][0]
            out.update(text=choice["message"]["content"], usage=data["usage"], finish=[choice["finish_reason"]], done=1,
                       migrations=data.get("prefixgate", {}).get("migrations", []))
            _take_logprobs(out, choice.get("logprobs"))
        else:
            async with http.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
                out["status"] = r.status_code
                if r.status_code != 200:
                    out["errors"].append((await r.aread())[:300].decode(errors="replace"))
                    return out
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        out["done"] += 1
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            out["errors"].append(chunk["error"])
                            continue
                        out["usage"] = chunk.get("usage") or out["usage"]
                        for c in chunk["choices"]:
                            out["text"] += c["delta"].get("content") or ""
                            if c["finish_reason"]:
                                out["finish"].append(c["finish_reason"])
                            _take_logprobs(out, c.get("logprobs"))
    except httpx.HTTPError as e:
        out["errors"].append(repr(e))
        return out
    out["ok"] = out["status"] == 200 and not out["errors"] and out["done"] == 1 and len(out["finish"]) == 1 \
        and out["usage"] is not None
    return out


def _take_logprobs(out: dict, logprobs: dict | None) -> None:
    for e in (logprobs or {}).get("content") or []:
        out["tokens"].append(e["token"])
        out["top"].append([t["logprob"] for t in e.get("top_logprobs", [])])


async def _load(url: str, sessions: int, turns: int, max_tokens: int, tag: str) -> list[dict]:
    async with httpx.AsyncClient(timeout=300) as http:
        async def session(s: int) -> list[dict]:
            results = []
            for t in range(turns):
                res = await _one(http, url, _body(s, t, s % 2 == 0, max_tokens), f"{tag}-{s}")
                res.update(session=s, turn=t, stream=s % 2 == 0)
                results.append(res)
            return results

        per = await asyncio.gather(*(session(s) for s in range(sessions)))
    return [r for rs in per for r in rs]


def _pids(config: AppConfig) -> dict[str, int]:
    client = redis.Redis.from_url(config.redis_url, decode_responses=True)
    out = {}
    for rid in client.smembers(RedisKeys(config.key_prefix).replicas):
        hb = client.hgetall(RedisKeys(config.key_prefix).heartbeat(rid))
        if hb.get("pid"):
            out[rid] = int(hb["pid"])
    return out


async def _faults(stack: LocalStack, redis_server: LocalRedis, args, log: list) -> None:
    t0 = time.monotonic()

    async def at(t: float) -> None:
        await asyncio.sleep(max(0.0, t0 + t - time.monotonic()))

    await at(args.first_kill_s)
    for k in range(2):
        if k:
            await at(args.first_kill_s + args.kill_gap_s)
        pids = _pids(stack.config)
        busiest = max(pids, key=lambda rid: int(redis.Redis.from_url(stack.config.redis_url).hget(
            RedisKeys(stack.config.key_prefix).heartbeat(rid), "running") or 0))
        os.kill(pids[busiest], signal.SIGKILL)
        log.append({"t": round(time.monotonic() - t0, 1), "event": f"SIGKILL replica {busiest} (pid {pids[busiest]})"})
        if k == 0:
            await at(args.first_kill_s + args.redis_after_kill_s)
            redis_server.stop()
            log.append({"t": round(time.monotonic() - t0, 1), "event": "redis stopped"})
            await asyncio.sleep(args.redis_outage_s)
            redis_server.start()
            log.append({"t": round(time.monotonic() - t0, 1), "event": "redis started"})


def _compare(reference: list[dict], disturbed: list[dict]) -> dict:
    ref = {(r["session"], r["turn"]): r for r in reference}
    diffs, identical, migrations = [], 0, []
    for d in disturbed:
        r = ref[(d["session"], d["turn"])]
        migrations += [{**m, "stream": d["stream"]} for m in d["migrations"]]
        if not d["ok"]:
            continue
        if d["text"] == r["text"]:
            identical += 1
            continue
        j = next((i for i, (a, b) in enumerate(zip(r["tokens"], d["tokens"], strict=False)) if a != b),
                 min(len(r["tokens"]), len(d["tokens"])))
        top = r["top"][j] if j < len(r["top"]) else []
        gap = top[0] - top[1] if len(top) >= 2 else None
        diffs.append({"session": d["session"], "turn": d["turn"], "first_diff_token": j, "top2_gap": gap})
    return {"identical": identical, "differing": diffs, "migrations": migrations}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--first-kill-s", type=float, default=8.0)
    p.add_argument("--kill-gap-s", type=float, default=30.0)
    p.add_argument("--redis-after-kill-s", type=float, default=4.0)
    p.add_argument("--redis-outage-s", type=float, default=20.0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    redis_server = LocalRedis().start()
    config = AppConfig(redis_url=redis_server.url, key_prefix=f"drill-{uuid.uuid4().hex[:6]}", replicas=2,
                       kv_cache_mb=64, max_model_len=2048)
    stack = LocalStack(config, port=free_port())
    try:
        t = time.monotonic()
        stack.start()
        print(f"stack up in {time.monotonic() - t:.0f}s", flush=True)
        t = time.monotonic()
        reference = asyncio.run(_load(stack.url, args.sessions, args.turns, args.max_tokens, "ref"))
        ref_s = time.monotonic() - t
        print(f"undisturbed run: {len(reference)} requests in {ref_s:.0f}s", flush=True)

        async def disturbed_run():
            log: list = []
            faults = asyncio.create_task(_faults(stack, redis_server, args, log))
            results = await _load(stack.url, args.sessions, args.turns, args.max_tokens, "drill")
            await faults  # the drill covers both kills even if the load finished first
            return results, log

        t = time.monotonic()
        disturbed, log = asyncio.run(disturbed_run())
        dis_s = time.monotonic() - t
        cmp = _compare(reference, disturbed)
        failed = [d for d in disturbed if not d["ok"]]
        summary = {
            "requests": len(disturbed), "failed": len(failed), "failures": [d["errors"] for d in failed][:5],
            "streams": sum(d["stream"] for d in disturbed),
            "identical_to_undisturbed": cmp["identical"], "differing": cmp["differing"],
            "migrations": cmp["migrations"], "faults": log, "undisturbed_s": round(ref_s, 1),
            "disturbed_s": round(dis_s, 1), "args": vars(args),
        }
        moved = [m for m in cmp["migrations"] if m["sent_tokens"]]
        print(json.dumps({k: v for k, v in summary.items() if k != "migrations"}, indent=1))
        print(f"{len(cmp['migrations'])} replica failures survived, {len(moved)} mid-stream: "
              + ", ".join(f"{m['sent_tokens']} sent / {m['recompute_tokens']} recomputed" for m in moved))
        if args.out:
            Path(args.out).write_text(json.dumps(summary, indent=1))
        return 0 if not failed else 1
    finally:
        stack.stop()
        redis_server.cleanup()


if __name__ == "__main__":
    sys.exit(main())
