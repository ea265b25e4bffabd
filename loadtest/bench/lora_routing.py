"""LoRA routing: adapter-aware routing against routing that ignores adapters, one run, the same
requests in the same order on fresh replicas.

    prefixgate bench lora-routing [--adapters 8] [--sessions 8] [--turns 2] [--concurrency 8]

A local stack of 2 replicas of the bundled model (our engine) serving `--adapters` random peft
adapters, `--max-cpu-loras` of them resident per replica (the rest read from disk on demand).
Traffic: for each adapter `--sessions` conversations of `--turns` turns (a session keeps its
adapter, as one customer's bot does), every conversation opening with the same product
preamble (a shared system prompt: the same tokens under different adapters are different K/V).
`--concurrency` clients each run one conversation at a time, drawn in a seeded order. The
defaults make the adapters' preambles together (8 x ~830 tokens) larger than one replica's cache
(256 blocks of 16): the case where routing decides the hit rate. With a preamble set one replica
can hold (`--preamble-words 320`), a router that ignores adapters keeps most hits by sending
every conversation where the preamble's text went (docs/benchmarks.md, "LoRA routing").

Arms: `lora_aware true` (the default: an adapter's prompts hashed under its identity, replicas
priced by whether they hold it) and `lora_aware false` (every request hashed as the base model's,
as routers that do not know adapters do). Each arm gets a fresh deployment (new replicas, empty
caches, its own Redis keys). Reported per arm: the prompt tokens served from cache (from each
response's usage), TTFT p50/p99 (first content event, streaming), and the wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx

from gateway.config import AppConfig
from gateway.stack import LocalStack
from loadtest.summary import percentile

say = functools.partial(print, flush=True)
WORDS = ("account billing invoice refund shipping order warranty device firmware router signal battery "
         "screen password login subscription plan upgrade support ticket escalate policy customer return "
         "exchange replacement delivery tracking address payment card update settings network").split()


@dataclass
class Arm:
    name: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    errors: int = 0
    wall_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def conversations(args: argparse.Namespace, adapters: list[str]) -> list[tuple[str, str, list[str]]]:
    """(adapter, session id, user turns) per conversation, in the seeded order both arms replay."""
    rng = random.Random(args.seed)
    convs = [(name, f"{name}-s{i}", [_text(rng, args.turn_words) + "?" for _ in range(args.turns)])
             for name in adapters for i in range(args.sessions)]
    rng.shuffle(convs)
    return convs


async def _turn(http: httpx.AsyncClient, url: str, body: dict, session: str, arm: Arm) -> str:
    start = time.perf_counter()
    first, text = None, []
    async with http.stream("POST", url, json=body, headers={"x-session-id": session}) as r:
        if r.status_code != 200:
            arm.errors += 1
            say(f"  {session}: HTTP {r.status_code} {(await r.aread())[:200]!r}")
            return ""
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first if first is not None else time.perf_counter() - start
                    text.append(piece)
            usage = event.get("usage")
            if usage:
                arm.prompt_tokens += usage["prompt_tokens"]
                arm.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    if first is not None:
        arm.ttft_s.append(first)
    return "".join(text)


async def drive(base: str, args: argparse.Namespace, preamble: str, convs, arm: Arm) -> None:
    queue = list(convs)
    url = f"{base}/v1/chat/completions"

    async def client(http: httpx.AsyncClient) -> None:
        while queue:
            adapter, session, turns = queue.pop(0)
            messages = [{"role": "system", "content": preamble}]
            for user in turns:
                messages.append({"role": "user", "content": user})
                body = {"model": adapter, "messages": messages, "max_tokens": args.max_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                answer = await _turn(http, url, body, session, arm)
                messages.append({"role": "assistant", "content": answer})

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(args.concurrency)))
        arm.wall_s = time.perf_counter() - t0


def build_adapters(n: int, rank: int, where: Path) -> dict[str, str]:
    from loadtest.bench.lora_adapters import ATTENTION, make_adapter
    from replica.default_model import default_model_dir

    model = str(default_model_dir())
    return {f"bot{i}": make_adapter(model, str(where / f"bot{i}"), ATTENTION, rank, seed=100 + i) for i in range(n)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prefixgate bench lora-routing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", type=int, default=8, help="LoRA adapters served (one per customer's bot)")
    p.add_argument("--sessions", type=int, default=8, help="conversations per adapter")
    p.add_argument("--turns", type=int, default=2, help="user turns per conversation")
    p.add_argument("--concurrency", type=int, default=8, help="conversations in flight at once")
    p.add_argument("--preamble-words", type=int, default=800, help="the shared system prompt's length, words")
    p.add_argument("--turn-words", type=int, default=12, help="each user turn's length, words")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per answer")
    p.add_argument("--max-cpu-loras", type=int, default=2, help="adapters resident per replica")
    p.add_argument("--max-loras", type=int, default=2, help="adapters in one batch per replica")
    p.add_argument("--num-blocks", type=int, default=256, help="K/V blocks per replica")
    p.add_argument("--rank", type=int, default=8, help="each adapter's LoRA rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="lora-routing-") as tmp:
        say(f"[lora-routing] building {args.adapters} adapters (peft, rank {args.rank})")
        adapters = build_adapters(args.adapters, args.rank, Path(tmp))
        preamble = "You are the support assistant of Northwind devices. " + _text(random.Random(args.seed + 1),
                                                                                   args.preamble_words)
        convs = conversations(args, list(adapters))
        config = AppConfig(replicas=2, lora=adapters, max_cpu_loras=args.max_cpu_loras, max_loras=args.max_loras,
                           num_blocks=args.num_blocks, max_model_len=2048, redis_url="auto")
        from gateway.local_redis import free_port

        stack = LocalStack(config, port=free_port())
        arms = []
        try:
            stack.start()
            for aware in (True, False):
                arm = Arm("adapter-aware" if aware else "ignores adapters")
                stack.deploy(replace(config, lora_aware=aware, key_prefix=f"lr-{uuid.uuid4().hex[:6]}",
                                     redis_url=stack.config.redis_url))
                say(f"[lora-routing] {arm.name}: {len(convs)} conversations x {args.turns} turns, "
                    f"concurrency {args.concurrency}")
                asyncio.run(drive(stack.url, args, preamble, convs, arm))
                arms.append(arm)
                say(f"  hit {arm.hit_rate:.1%}  TTFT p50 {percentile(arm.ttft_s, 50) * 1000:.0f} ms  "
                    f"p99 {percentile(arm.ttft_s, 99) * 1000:.0f} ms  {arm.wall_s:.1f} s  errors {arm.errors}")
        finally:
            stack.stop()
    aware, blind = arms
    say("\n| routing | prompt tokens from cache | TTFT p50 | TTFT p99 | run time | errors |")
    say("| --- | --- | --- | --- | --- | --- |")
    for arm in arms:
        say(f"| {arm.name} | {arm.hit_rate:.1%} | {percentile(arm.ttft_s, 50) * 1000:.0f} ms | "
            f"{percentile(arm.ttft_s, 99) * 1000:.0f} ms | {arm.wall_s:.1f} s | {arm.errors} |")
    gain = (aware.hit_rate - blind.hit_rate) * 100
    p99 = percentile(aware.ttft_s, 99) / max(percentile(blind.ttft_s, 99), 1e-9)
    say(f"\nadapter-aware: {gain:+.1f} points of prompt tokens from cache, TTFT p99 x{p99:.2f} of the blind router's "
        f"(targets: >= +10 points, below x1.00)")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "arms": [asdict(a) | {"hit_rate": a.hit_rate} for a in arms]}, indent=1))
    return 0 if not (aware.errors or blind.errors) else 1


if __name__ == "__main__":
    sys.exit(main())
