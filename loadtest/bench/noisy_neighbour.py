"""Noisy neighbour: a quiet tenant's time to first token beside a tenant that floods the replicas,
with flow control off (the old admission: in flight up to the bound, FIFO below it) and on
(gateway/flow/: priority, then weighted fair queuing between tenants), in one session.

A local stack (2 `--engine sim` replicas by default: real scheduler, cache and publisher, modelled
compute), two API keys (tenants `flood` and `quiet`). For each flood shape and each mode:

  quiet alone   one client, one short streaming request at a time (a think time between them)
  flood alone   `--flood-streams` clients, each sending long requests back to back
  together      both at once

Reported: the quiet tenant's TTFT p50/p99 (first content event), the flood's output tokens/s
(counted from `usage` of the requests completed in the window, not from SSE events), the
quiet requests each window measured (`quiet n`: beside a flood of long prompts a quiet request
decodes at the flood's step time, so a 20-s window holds a dozen, and their p99 is their
maximum; the JSON lists them all), and refusals. Targets: quiet TTFT p99 together <= 2x alone; flood tokens/s together >=
90% of alone. With `--flood-tier flex --quiet-tier priority` the same run measures the priority
target: priority requests' TTFT p99 under a flex flood <= 1.5x alone.

    prefixgate bench noisy-neighbour --duration 30 --json /tmp/nn.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

from gateway.config import AppConfig
from gateway.stack import LocalStack
from loadtest.bench.stack_options import add_config_option, add_ingress_option, config_overrides
from loadtest.summary import percentile
from replica.backends.engines import engine_spec

RAY_WORKER_NICENESS = 15  # Ray starts its workers (the replicas, the gateway, the proxy) at this niceness
KEYS = {"sk-flood": "flood", "sk-quiet": "quiet"}
# flood shapes: (prompt tokens, max_tokens) per request
SHAPES = {"long-prompts": (1500, 32), "long-outputs": (200, 256)}


@dataclass
class Window:
    quiet_ttft_ms: list[float] = field(default_factory=list)
    quiet_sent_s: list[float] = field(default_factory=list)  # when each was sent, seconds after the flood began
    flood_tokens: int = 0
    flood_requests: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    flood_nice: int | None = None  # the niceness each tenant's client process ran at
    quiet_nice: int | None = None


@dataclass
class Row:
    mode: str
    shape: str
    quiet_alone_p50_ms: float
    quiet_alone_p99_ms: float
    quiet_together_p50_ms: float
    quiet_together_p99_ms: float
    flood_alone_tok_s: float
    flood_together_tok_s: float
    refused_together: dict[str, int]
    # every quiet TTFT of both windows in the order sent (the JSON's; a p99 of a few dozen is
    # nearly their maximum, so where the slow ones fall says what they waited for)
    quiet_alone_ttft_ms: list[float] = field(default_factory=list)
    quiet_together_ttft_ms: list[float] = field(default_factory=list)
    quiet_together_sent_s: list[float] = field(default_factory=list)  # each one's send time, s after the flood began
    quiet_slo_ttft_ms: int | None = None  # the quiet tenant's x-slo-ttft-ms (None: not sent)
    quiet_refused: int = 0  # quiet requests refused beside the flood (misses of the objective)

    @property
    def ttft_ratio(self) -> float:
        return self.quiet_together_p99_ms / max(self.quiet_alone_p99_ms, 1e-9)

    @property
    def slo_attainment(self) -> float | None:
        """Quiet requests beside the flood that met their TTFT objective, refusals counted as
        misses (None: no objective sent)."""
        if self.quiet_slo_ttft_ms is None:
            return None
        sent = len(self.quiet_together_ttft_ms) + self.quiet_refused
        met = sum(t <= self.quiet_slo_ttft_ms for t in self.quiet_together_ttft_ms)
        return met / sent if sent else 0.0

    @property
    def tok_ratio(self) -> float:
        return self.flood_together_tok_s / max(self.flood_alone_tok_s, 1e-9)


async def stream_completion(http: httpx.AsyncClient, url: str, key: str, body: dict, first: list[float] | None = None,
                            retry_after: list[float] | None = None, headers: dict[str, str] | None = None,
                            ) -> tuple[float | None, int, str | None]:
    """(TTFT s, completion tokens from usage, refusal code) of one streaming completion; the
    TTFT is also appended to `first` as soon as it is known, a refusal's Retry-After (seconds)
    to `retry_after`. `headers`: sent besides the key (x-slo-ttft-ms)."""
    start = time.perf_counter()
    ttft, tokens = None, 0
    async with http.stream("POST", url, json=body, headers={"authorization": f"Bearer {key}", **(headers or {})}) as r:
        if r.status_code != 200:
            if retry_after is not None and r.headers.get("retry-after", "").isdigit():
                retry_after.append(float(r.headers["retry-after"]))
            data = await r.aread()
            try:
                code = json.loads(data)["error"]["code"] or str(r.status_code)
            except Exception:
                code = str(r.status_code)
            return None, 0, code
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            choices = event.get("choices") or []
            if ttft is None and choices and choices[0].get("text"):
                ttft = time.perf_counter() - start
                if first is not None:
                    first.append(ttft)
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return ttft, tokens, None


def completion_body(model: str, prompt_tokens: int, max_tokens: int, rng: random.Random, tier: str | None = None) -> dict:
    # token ids, so the prompt length is exact; random so nothing is a prefix-cache hit
    body = {"model": model, "prompt": [rng.randrange(1000, 20000) for _ in range(prompt_tokens)],
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    return body if tier is None else {**body, "service_tier": tier}


async def window(base: str, model: str, seconds: float, quiet: bool, flood: tuple[int, int] | None,
                 flood_streams: int, quiet_prompt: int, quiet_max_tokens: int, think_s: float, seed: int,
                 warmup_s: float = 10.0, flood_tier: str | None = None, quiet_tier: str | None = None,
                 flood_retry_s: float | None = None, quiet_slo_ttft_ms: int | None = None) -> Window:
    """One measured window of `seconds`, after `warmup_s` of the flood alone (its queue fills).
    Flood tokens: requests that completed inside the window. Quiet TTFTs: requests sent inside
    it; one still without a token when the window ends counts its wait so far (a lower bound).
    A refused flood request is retried after the response's Retry-After, as OpenAI's SDK does
    (`flood_retry_s`: after that many seconds instead, a client that ignores it). Quiet requests
    carry `x-slo-ttft-ms: quiet_slo_ttft_ms` when it is set."""
    url = f"{base}/v1/completions"
    out = Window(seconds=seconds)
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=flood_streams + 8, max_keepalive_connections=flood_streams + 8)
    warmup = warmup_s
    quiet_headers = {"x-slo-ttft-ms": str(quiet_slo_ttft_ms)} if quiet_slo_ttft_ms else None
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        t0 = time.perf_counter()
        begin, end = t0 + warmup, t0 + warmup + seconds
        # quiet requests not finished: id -> (sent at, its first-token list, filled when it arrives)
        pending: dict[int, tuple[float, list[float]]] = {}

        async def flood_loop() -> None:
            while time.perf_counter() < end:
                told: list[float] = []
                _, tokens, code = await stream_completion(http, url, "sk-flood", completion_body(model, *flood, rng, flood_tier),
                                                          retry_after=told)
                done = time.perf_counter()
                if code is not None:
                    if done >= begin:
                        out.refused[code] = out.refused.get(code, 0) + 1
                    await asyncio.sleep(told[0] if told and flood_retry_s is None else (flood_retry_s or 0.05))
                elif begin <= done <= end:
                    out.flood_tokens += tokens
                    out.flood_requests += 1

        async def quiet_loop() -> None:
            await asyncio.sleep(warmup)
            n = 0
            while time.perf_counter() < end:
                n += 1
                sent, first = time.perf_counter(), []
                pending[n] = (sent, first)
                try:
                    _, _, code = await stream_completion(http, url, "sk-quiet", completion_body(model, quiet_prompt, quiet_max_tokens, rng, quiet_tier), first,
                                                        headers=quiet_headers)
                finally:
                    if first:
                        pending.pop(n, None)
                        out.quiet_ttft_ms.append(first[0] * 1000)
                        out.quiet_sent_s.append(round(sent - t0, 2))
                if code is not None:
                    pending.pop(n, None)
                    out.refused["quiet:" + code] = out.refused.get("quiet:" + code, 0) + 1
                await asyncio.sleep(think_s)

        tasks = [asyncio.create_task(flood_loop()) for _ in range(flood_streams if flood else 0)]
        if quiet:
            tasks.append(asyncio.create_task(quiet_loop()))
        await asyncio.sleep(max(0.0, end - time.perf_counter()))
        now = time.perf_counter()
        # censored: still without a first token (one that has it, still decoding, records its
        # own TTFT when cancelled; counting its time so far too would add a false late request)
        waiting = [sent for sent, first in pending.values() if not first]
        out.quiet_ttft_ms += [(now - sent) * 1000 for sent in waiting]
        out.quiet_sent_s += [round(sent - t0, 2) for sent in waiting]
        for t in tasks:  # requests still running at the window's end are not counted
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return out


def measure(args: argparse.Namespace, base: str, model: str, quiet: bool, flood: tuple[int, int] | None,
            seed: int) -> Window:
    """One window, each tenant's clients in a process of their own (as real clients are: the
    quiet tenant's TTFT is not measured on an event loop busy parsing the flood's events)."""
    common = dict(base=base, model=model, seconds=args.duration, flood_streams=args.flood_streams,
                  quiet_prompt=args.quiet_prompt, quiet_max_tokens=args.quiet_max_tokens, think_s=args.think_s,
                  warmup_s=args.warmup_s if flood else 0.0, flood_tier=args.flood_tier, quiet_tier=args.quiet_tier,
                  flood_retry_s=args.flood_retry_s, quiet_slo_ttft_ms=args.quiet_slo_ttft_ms)
    roles = []
    if flood:
        roles.append({**common, "quiet": False, "flood": list(flood), "seed": seed})
    if quiet:
        roles.append({**common, "quiet": True, "flood": None, "flood_streams": 0, "seed": seed + 100})
    def niced(role: dict):  # the flood's load generator runs at the servers' niceness, never above them
        return (lambda: os.nice(args.flood_nice)) if args.flood_nice and not role["quiet"] else None

    procs = [subprocess.Popen([sys.executable, "-m", "loadtest.bench.noisy_neighbour", "--client", json.dumps(r)],
                              stdout=subprocess.PIPE, text=True, preexec_fn=niced(r)) for r in roles]
    out = Window(seconds=args.duration)
    for proc in procs:
        stdout, _ = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"a client process failed ({proc.returncode})")
        part = Window(**json.loads(stdout))
        out.quiet_ttft_ms += part.quiet_ttft_ms
        out.quiet_sent_s += part.quiet_sent_s
        out.flood_tokens += part.flood_tokens
        out.flood_requests += part.flood_requests
        for k, v in part.refused.items():
            out.refused[k] = out.refused.get(k, 0) + v
        out.flood_nice = part.flood_nice if part.flood_nice is not None else out.flood_nice
        out.quiet_nice = part.quiet_nice if part.quiet_nice is not None else out.quiet_nice
    return out


def run_mode(args: argparse.Namespace, stack: LocalStack, model: str, mode: str) -> list[Row]:
    rows = []
    for shape in args.shapes:
        flood = SHAPES[shape]
        alone = measure(args, stack.url, model, quiet=True, flood=None, seed=1)
        flood_alone = measure(args, stack.url, model, quiet=False, flood=flood, seed=2)
        time.sleep(args.settle_s)
        together = measure(args, stack.url, model, quiet=True, flood=flood, seed=3)
        time.sleep(args.settle_s)
        row = Row(mode, shape,
                  percentile(alone.quiet_ttft_ms, 50) or 0.0, percentile(alone.quiet_ttft_ms, 99) or 0.0,
                  percentile(together.quiet_ttft_ms, 50) or 0.0, percentile(together.quiet_ttft_ms, 99) or 0.0,
                  flood_alone.flood_tokens / flood_alone.seconds, together.flood_tokens / together.seconds,
                  together.refused, [round(t, 1) for t in alone.quiet_ttft_ms],
                  [round(t, 1) for t in together.quiet_ttft_ms], together.quiet_sent_s, args.quiet_slo_ttft_ms,
                  sum(v for k, v in together.refused.items() if k.startswith("quiet:")))
        print(format_rows([row], header=not rows and mode == args.modes[0]), flush=True)
        rows.append(row)
    return rows


def format_rows(rows: list[Row], header: bool = True) -> str:
    head = (f"{'mode':<5} {'flood shape':<13} {'quiet p50/p99 alone':>20} {'quiet p50/p99 flood':>20} {'p99 x':>6} "
            f"{'flood tok/s alone':>17} {'with quiet':>10} {'tok %':>6} {'quiet n':>9} {'met slo':>8}  refused")
    lines = [head] if header else []
    for r in rows:
        lines.append(f"{r.mode:<5} {r.shape:<13} {r.quiet_alone_p50_ms:>8.0f}/{r.quiet_alone_p99_ms:>6.0f} ms "
                     f"{r.quiet_together_p50_ms:>8.0f}/{r.quiet_together_p99_ms:>6.0f} ms {r.ttft_ratio:>5.1f}x "
                     f"{r.flood_alone_tok_s:>17.0f} {r.flood_together_tok_s:>10.0f} {r.tok_ratio:>6.0%} "
                     f"{len(r.quiet_alone_ttft_ms):>4}/{len(r.quiet_together_ttft_ms):<4} "
                     f"{'-' if r.slo_attainment is None else f'{r.slo_attainment:.1%}':>8}  "
                     f"{r.refused_together or '-'}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="prefixgate bench noisy-neighbour", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="sim", choices=("sim", "model"))
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--duration", type=float, default=30.0, help="seconds measured per window")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--modes", nargs="+", default=["off", "on"], choices=("off", "on"), help="flow control off / on")
    p.add_argument("--flood-streams", type=int, default=96, help="concurrent flood clients")
    p.add_argument("--quiet-prompt", type=int, default=48, help="quiet request's prompt tokens")
    p.add_argument("--quiet-max-tokens", type=int, default=16)
    p.add_argument("--flood-tier", choices=("auto", "default", "flex", "priority"),
                   help="the flood's service_tier (e.g. flex; none sent: the key's default)")
    p.add_argument("--quiet-tier", choices=("auto", "default", "flex", "priority"),
                   help="the quiet tenant's service_tier (e.g. priority, for the priority target)")
    p.add_argument("--flood-retry-s", type=float, default=None,
                   help="a refused flood request is retried after this many seconds (default: the response's "
                        "Retry-After, as OpenAI's SDK does; e.g. 0.05 for a client that ignores it)")
    p.add_argument("--quiet-slo-ttft-ms", type=int, default=None,
                   help="the quiet tenant's requests carry x-slo-ttft-ms with this value; the row reports the share "
                        "beside the flood that met it (refusals count as misses)")
    p.add_argument("--think-s", type=float, default=0.1, help="quiet client's pause between requests")
    p.add_argument("--warmup-s", type=float, default=10.0, help="flood alone before a window is measured")
    p.add_argument("--settle-s", type=float, default=5.0, help="pause after a flood window (its cancelled requests end)")
    p.add_argument("--port", type=int, default=8124)
    p.add_argument("--flood-nice", type=int, default=RAY_WORKER_NICENESS,
                   help="the flood client's niceness (default: Ray's workers', so the load generator never outranks "
                        "the servers it loads on a shared machine; the quiet client, the instrument, runs at 0)")
    add_config_option(p, "flow_prefill_tokens=512")
    add_ingress_option(p)
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--client"]:  # one tenant's clients (measure() starts these)
        spec = json.loads(argv[1])
        if spec["flood"]:
            spec["flood"] = tuple(spec["flood"])
        out = asyncio.run(window(**spec))
        if spec["quiet"]:
            out.quiet_nice = os.nice(0)
        else:
            out.flood_nice = os.nice(0)
        print(json.dumps(asdict(out)))
        return 0
    args = parse_args(argv)
    overrides = config_overrides(args)
    # a Redis of its own ('auto'): AppConfig's default names a deployment's, and a stack
    # without one routes every request `stale` and runs flow control without heartbeats
    base = dict(engine=args.engine, replicas=args.replicas, api_keys=dict(KEYS), max_model_len=4096,
                default_max_tokens=64, **{"redis_url": "auto", **overrides})
    if engine_spec(args.engine).default_num_blocks is not None:  # a pool of blocks, not of a model's memory (sim)
        base.setdefault("num_blocks", 4096)
    stack = LocalStack(AppConfig(flow_control=args.modes[0] == "on", **base), port=args.port, ingress=args.ingress)
    rows: list[Row] = []
    try:
        stack.start()
        model = httpx.get(f"{stack.url}/v1/models", timeout=10, headers={"authorization": "Bearer sk-quiet"}).json()["data"][0]["id"]
        for i, mode in enumerate(args.modes):
            if i:
                stack.deploy(AppConfig(flow_control=mode == "on", **base))
            asyncio.run(window(stack.url, model, seconds=2, quiet=True, flood=None, flood_streams=1, quiet_prompt=16,
                               quiet_max_tokens=4, think_s=0.0, seed=0, warmup_s=0.0))  # warm-up
            time.sleep(args.settle_s)  # the previous window's cancelled requests leave the replicas
            rows += run_mode(args, stack, model, mode)
    finally:
        stack.stop()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([{**asdict(r), "ttft_ratio": r.ttft_ratio, "tok_ratio": r.tok_ratio,
                        "slo_attainment": r.slo_attainment} for r in rows], fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
