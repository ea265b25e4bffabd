"""Goodput: requests per second that meet both latency objectives (DistServe's measure), on a
fixed mix (loadtest/bench/goodput_mix.py: 60% chat over shared system prompts, 30% RAG over 8
shared documents, 10% batch on `flex`), for three modes on the same arrivals:

  slo           the default policy; chat and RAG requests carry `x-slo-ttft-ms` / `x-slo-tpot-ms`
                (the router then decides them with `slo`, router/slo_policy.py; the gateway
                orders and sheds by them)
  default       the same stack, no objective headers (today's routing)
  least-loaded  `--policy least-loaded`, no objective headers

Without headers, attainment is judged client-side against the same objectives.

A run: a local stack (`--replicas` `--engine sim` replicas by default, GPU service model), each
shared prefix sent once, then the calibration: each class alone, one request at a time
(`--calibration-requests` each): TTFT p50 and TPOT p50 per class set the objectives (chat TTFT
3x, TPOT 2x; RAG TTFT 5x, TPOT 3x); then each class as a burst of `--calibration-batch`
requests per replica: the capacity, capacity = 1 / sum_c (share_c / X_c), X_c the class's burst
throughput (goodput_score.py). Then per mode, on fresh replicas (a redeploy under a key prefix
of its own) warmed the same way (the shared prefixes, then min(window, 10) s at 30% of capacity,
not measured): Poisson arrivals (seeded) at k x 10% of capacity, k = 1, 2, ..., each for
`--window` seconds, every request waited on to its end, until attainment of both objectives
falls under 50% or `--max-steps`. Per mode and rate: attainment of TTFT, TPOT and both (per
class and overall), goodput, TTFT p50/p99; then issue 52's figures: `slo`'s attainment at the
rate where `default` falls through 80%, and each mode's highest rate held at >= 90% with the
ratio slo / default (goodput_score.py defines both). `--seed 0` is for tuning; seeds 1 and 2
are the reported ones.

    prefixgate bench goodput --seed 1 --json /tmp/goodput.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import AppConfig
from gateway.stack import LocalStack
from loadtest.bench.goodput_mix import CLASSES, Mix, Request, arrivals
from loadtest.bench.goodput_score import (
    ClassCalibration,
    Outcome,
    StepResult,
    capacity,
    objectives,
    score,
    summary,
)
from loadtest.bench.stack_options import add_config_option, config_overrides
from loadtest.summary import percentile
from replica.backends.engines import engine_spec

MODES = ("slo", "default", "least-loaded")
MODEL_LENGTH_SCALE = 0.125  # --engine model: prompt lengths x this (2 CPU replicas of a 135M model)
STOP_BELOW = 0.5  # a mode stops after the first rate whose attainment of both is under this
WARM_RATE = 0.3  # warm-up traffic, x capacity


def body(model: str, req: Request) -> dict:
    out = {"model": model, "prompt": list(req.prompt), "max_tokens": req.max_tokens, "stream": True, "ignore_eos": True,
           "temperature": 0, "stream_options": {"include_usage": True}}
    return out if req.tier is None else {**out, "service_tier": req.tier}


async def send(http: httpx.AsyncClient, url: str, model: str, req: Request, headers: dict[str, str]) -> Outcome:
    """One streaming completion, timed at its first and last content events. (Not
    noisy_neighbour.stream_completion: it sends no headers of the request's own and keeps no
    last-event time.)"""
    out = Outcome(req.cls)
    start = time.perf_counter()
    first = last = None
    try:
        async with http.stream("POST", url, json=body(model, req), headers=headers) as r:
            if r.status_code != 200:
                data = await r.aread()
                try:
                    code = json.loads(data)["error"]["code"] or str(r.status_code)
                except Exception:
                    code = str(r.status_code)
                if r.status_code == 429:
                    out.refused = code
                else:
                    out.failed = code
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                choices = event.get("choices") or []
                if choices and choices[0].get("text"):
                    last = time.perf_counter()
                    first = first or last
                if event.get("usage"):
                    out.tokens = event["usage"]["completion_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out.failed = type(e).__name__
        return out
    if first is None or out.tokens != req.max_tokens:
        out.failed = "incomplete"
        return out
    out.ttft_s = first - start
    out.tpot_s = (last - first) / (out.tokens - 1) if out.tokens > 1 else 0.0
    return out


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))


async def open_loop(url: str, model: str, schedule: list[tuple[float, Request]],
                    headers: dict[str, dict[str, str]]) -> list[Outcome]:
    """Send each request at its offset; wait for every one's end. `headers`: per class."""
    async with _client() as http:
        start, tasks = time.perf_counter(), []
        for offset, req in schedule:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            tasks.append(asyncio.create_task(send(http, url, model, req, headers.get(req.cls, {}))))
        return list(await asyncio.gather(*tasks))


async def at_once(url: str, model: str, reqs: list[Request]) -> tuple[list[Outcome], float]:
    async with _client() as http:
        start = time.perf_counter()
        outs = await asyncio.gather(*(send(http, url, model, r, {}) for r in reqs))
        return list(outs), time.perf_counter() - start


async def calibrate(url: str, model: str, mix: Mix, n: int, batch: int, replicas: int, seed: int) -> dict[str, ClassCalibration]:
    rng = random.Random(seed * 7919 + 1)
    out = {}
    async with _client() as http:
        alone: dict[str, list[Outcome]] = {c.name: [] for c in CLASSES}
        for c in CLASSES:
            for _ in range(n):
                alone[c.name].append(await send(http, url, model, mix.request(c.name, rng), {}))
    for c in CLASSES:
        done = [o for o in alone[c.name] if o.ttft_s is not None]
        if not done:
            raise RuntimeError(f"calibration: no {c.name} request completed ({alone[c.name]})")
        outs, seconds = await at_once(url, model, [mix.request(c.name, rng) for _ in range(batch * replicas)])
        completed = sum(o.ttft_s is not None for o in outs)
        out[c.name] = ClassCalibration(ttft_p50_ms=percentile([o.ttft_s * 1000 for o in done], 50),
                                       tpot_p50_ms=percentile([o.tpot_s * 1000 for o in done], 50),
                                       burst_rps=max(completed, 1) / seconds, n=len(done))
    return out


def slo_headers(objs: dict[str, dict[str, int]]) -> dict[str, dict[str, str]]:
    return {cls: {"x-slo-ttft-ms": str(o["ttft_ms"]), "x-slo-tpot-ms": str(o["tpot_ms"])} for cls, o in objs.items()}


def run_mode(stack: LocalStack, config: AppConfig, model: str, mix: Mix, mode: str, objs: dict, cap: float,
             args: argparse.Namespace, header: bool) -> tuple[list[StepResult], dict[str, dict[str, float | None]]]:
    """The mode's steps, and its p90 coverage over all of them (`judged` and `covered` per objective)."""
    stack.deploy(config)
    url = f"{stack.url}/v1/completions"
    headers = slo_headers(objs) if mode == "slo" else {}
    asyncio.run(at_once(url, model, mix.warmers()))
    asyncio.run(open_loop(url, model, arrivals(mix, WARM_RATE * cap, min(args.window, 10.0), args.seed, 0), headers))
    steps = []
    first = coverage_counts(stack.url)
    for k in range(1, args.max_steps + 1):
        rate = k * 0.1 * cap
        before = coverage_counts(stack.url)
        outs = asyncio.run(open_loop(url, model, arrivals(mix, rate, args.window, args.seed, k), headers))
        steps.append(score(outs, objs, rate, args.window))
        steps[-1].coverage = coverage(before, coverage_counts(stack.url))
        print(format_step(mode, steps[-1], header=header and k == 1), flush=True)
        if steps[-1].attainment is not None and steps[-1].attainment < STOP_BELOW:
            break
    return steps, run_coverage(first, coverage_counts(stack.url))


def run_coverage(first: dict[str, tuple[float, float]], last: dict[str, tuple[float, float]]) -> dict[str, dict[str, float | None]]:
    """The p90's coverage per objective between two reads of the gateway's counters (a step, or a
    mode's measured steps together): the requests judged against a prediction, how many it
    covered, and their share (None: none judged)."""
    out: dict[str, dict[str, float | None]] = {}
    for objective, (n, covered) in last.items():
        n0, c0 = first.get(objective, (0.0, 0.0))
        judged = n - n0
        out[objective] = {"judged": judged, "covered": covered - c0, "share": (covered - c0) / judged if judged > 0 else None}
    return out


def coverage_counts(base: str) -> dict[str, tuple[float, float]]:
    """The gateway's (predictions, covered) so far per objective (ttft, tpot): how often the
    router's p90 prediction held what was observed (gateway/slo_watch.py)."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("prefixgate_slo_predictions_total", "prefixgate_slo_prediction_covered_total"):
                pair = out.setdefault(s.labels.get("objective", ""), [0.0, 0.0])
                pair[s.name == "prefixgate_slo_prediction_covered_total"] += s.value
    return {k: (v[0], v[1]) for k, v in out.items()}


def coverage(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float | None]:
    """The p90's coverage per objective over one step: covered / predictions (None: none judged)."""
    return {objective: c["share"] for objective, c in run_coverage(before, after).items()}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def format_step(mode: str, s: StepResult, header: bool = False) -> str:
    head = (f"{'mode':<12} {'rate':>6} {'sent':>5} {'both':>5} {'ttft':>5} {'tpot':>5} {'chat':>5} {'rag':>5} "
            f"{'goodput':>8} {'chat TTFT p50/p99':>18} {'rag TTFT p50/p99':>17} {'refused':>7} {'failed':>6} "
            f"{'p90 covers ttft/tpot':>20}")
    o, ch, rag = s.overall, s.classes["chat"], s.classes["rag"]
    refused = sum(c.refused for c in s.classes.values())
    failed = sum(c.failed for c in s.classes.values())
    line = (f"{mode:<12} {s.rate:>6.2f} {s.sent:>5} {_pct(o.attainment):>5} {_pct(o.ttft_attainment):>5} "
            f"{_pct(o.tpot_attainment):>5} {_pct(ch.attainment):>5} {_pct(rag.attainment):>5} {s.goodput:>8.2f} "
            f"{_ms(ch.ttft_p50_ms):>9}/{_ms(ch.ttft_p99_ms):<8} {_ms(rag.ttft_p50_ms):>8}/{_ms(rag.ttft_p99_ms):<8} "
            f"{refused:>7} {failed:>6} {_pct(s.coverage.get('ttft')):>11}/{_pct(s.coverage.get('tpot')):<8}")
    return f"{head}\n{line}" if header else line


def format_summary(sm: dict) -> str:
    lines = []
    for mode, h in sm["held_90"].items():
        lines.append(f"highest rate held at >= 90%: {mode:<12} {_rate(h)}")
    if "held_90_ratio_slo_default" in sm:
        lines.append(f"ratio slo / default: {sm['held_90_ratio_slo_default']:.2f}x (target >= 1.3x)")
    if "default_80" in sm:
        d = sm["default_80"]
        lines.append(f"default falls through 80% at {_rate(d)}; slo's attainment there (interpolated): "
                     f"{_pct(d.get('slo_attainment'))} (target >= 95%)")
    for objective, c in sm.get("slo_coverage", {}).items():
        lines.append(f"slo's p90 covered {_pct(c['share'])} of observed {objective.upper()}s over its steps "
                     f"({c['covered']:.0f} of {c['judged']:.0f}; target 85-95%)")
    return "\n".join(lines)


def _rate(c: dict) -> str:
    return f"{c['rate']:.2f} req/s ({c['how']})" if c["rate"] is not None else f"- ({c['how']})"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{os.cpu_count()} cores"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="prefixgate bench goodput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="sim", choices=("sim", "model"), help="sim: GPU service model; model: the bundled model")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--window", type=float, default=20.0, help="seconds of arrivals per rate")
    p.add_argument("--max-steps", type=int, default=20, help="at most this many rates per mode")
    p.add_argument("--seed", type=int, default=1, help="arrivals and draws (0: tuning; 1 and 2: reported)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--length-scale", type=float, default=None,
                   help=f"prompt lengths x this (default: 1 on sim, {MODEL_LENGTH_SCALE} on the bundled model)")
    p.add_argument("--calibration-requests", type=int, default=5, help="per class, one at a time: the unloaded p50s")
    p.add_argument("--calibration-batch", type=int, default=16, help="requests per replica in each class's capacity burst")
    p.add_argument("--port", type=int, default=8126)
    add_config_option(p, "time_scale=2")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.length_scale is None:
        args.length_scale = 1.0 if _modelled(args.engine) else MODEL_LENGTH_SCALE
    if not 0 < args.length_scale <= 1:
        p.error(f"--length-scale must be in (0, 1], got {args.length_scale}")
    return args


def _modelled(engine: str) -> bool:
    """An engine of modelled compute (the sim's pool of blocks, not of a model's memory): the mix
    as given; a real model's is scaled to what 2 CPU replicas serve."""
    return engine_spec(engine).default_num_blocks is not None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mix = Mix(args.length_scale)
    # a Redis of its own ('auto'); on sim the context the mix needs (RAG: 4,000 + 128 tokens)
    base = dict(engine=args.engine, replicas=args.replicas, max_model_len=8192 if _modelled(args.engine) else 4096,
                **{"redis_url": "auto", **config_overrides(args)})
    if _modelled(args.engine):
        base.setdefault("num_blocks", 4096)
    if base["max_model_len"] is not None and mix.longest() > base["max_model_len"]:
        raise SystemExit(f"the mix needs {mix.longest()} tokens of context, max_model_len is {base['max_model_len']}: "
                         "lower --length-scale")

    def config(mode: str) -> AppConfig:
        extra = {"policy": "least-loaded"} if mode == "least-loaded" else {}
        return AppConfig(**{**base, **extra, "key_prefix": f"goodput-{mode}"})

    settings = {k: v for k, v in vars(args).items() if k not in ("config", "json")}
    settings.update(max_model_len=base["max_model_len"], config=config_overrides(args))
    print(f"CPU: {cpu_name()}\nsettings: {settings}\nprompt length scale: x{args.length_scale}", flush=True)
    stack = LocalStack(config("calibration"), port=args.port)
    results: dict[str, list[StepResult]] = {}
    covered: dict[str, dict[str, dict[str, float | None]]] = {}
    try:
        stack.start()
        model = httpx.get(f"{stack.url}/v1/models", timeout=10).json()["data"][0]["id"]
        url = f"{stack.url}/v1/completions"
        asyncio.run(at_once(url, model, mix.warmers()))
        cal = asyncio.run(calibrate(url, model, mix, args.calibration_requests, args.calibration_batch, args.replicas, args.seed))
        objs, cap = objectives(cal), capacity(cal)
        for name, c in cal.items():
            o = objs.get(name)
            print(f"calibration {name:<5} TTFT p50 {c.ttft_p50_ms:7.0f} ms, TPOT p50 {c.tpot_p50_ms:5.1f} ms, burst "
                  f"{c.burst_rps:5.2f} req/s (n={c.n})" + (f" -> objectives TTFT {o['ttft_ms']} ms, TPOT {o['tpot_ms']} ms" if o else ""))
        print(f"capacity {cap:.2f} req/s; rates step by {0.1 * cap:.2f} req/s", flush=True)
        for i, mode in enumerate(args.modes):
            results[mode], covered[mode] = run_mode(stack, config(mode), model, mix, mode, objs, cap, args, header=i == 0)
    finally:
        stack.stop()
    sm = summary(results)
    if "slo" in covered:
        sm["slo_coverage"] = covered["slo"]
    print(format_summary(sm))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cpu": cpu_name(), "settings": settings, "calibration": {k: vars(v) for k, v in cal.items()},
                       "objectives": objs, "capacity_rps": cap, "step_rps": 0.1 * cap,
                       "classes": {c.name: vars(c) for c in CLASSES},
                       "modes": {m: [s.as_dict() for s in steps] for m, steps in results.items()}, "summary": sm}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

