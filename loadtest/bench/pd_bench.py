"""Prefill/decode split against colocated serving, live (issue 53; docs/prefill-decode.md).

One local stack; per arm a fresh deployment under a key prefix of its own (same Ray, same Redis):

  colocated   `--prefill-replicas` + `--decode-replicas` replicas that do both
  split       `--prefill-replicas` prefill replicas and `--decode-replicas` decode replicas

The same seeded workload on each: Poisson arrivals at `--rate` req/s for `--duration` s, a
`--long-share` of long prompts (past `--pd-threshold-tokens`) and the rest short chat-like ones
(under it), random token ids (nothing is a cache hit), `--max-tokens` output tokens, streamed;
every request is waited on to its end. Reported per arm: requests, failed (non-200, stream error
or short stream), TTFT p50/p99 (all; short prompts alone), TPOT p50/p99, output tokens/s. For the
split, from the decode replicas' own counts (`info()["stats"]["handover"]`, read through Ray as
K/V pulls call replicas; the prefixgate_pd_* metrics are Ray's, not in the gateway's /metrics):
the share of long prompts routed to a prefill replica and handed over, the outcomes, the
hand-over time p50/p99 (every ok one: polled while the run goes), K/V bytes per token handed
over; then a route check (a few long and short prompts, not streamed: their
`prefixgate.route.prefill_from`, which a stream does not carry), and once idle whether the
prefill replicas' heartbeats show no block in use (free + cached == capacity: nothing left pinned).

`--kill-prefill-every S` (the split arm only): every S seconds, the first at S/2, a prefill
replica with a hand-over in flight (the first its heartbeats show busy, waited for up to S/2) has
its actor killed (Serve starts another); interrupted hand-overs recovered = the run's `failed` + `timeout` outcomes, each
computed on its decode replica instead (the client saw one stream).

    prefixgate bench pd --json /tmp/pd.json
    prefixgate bench pd --arms split --duration 300 --kill-prefill-every 60 --json /tmp/pd-faults.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from gateway.config import AppConfig
from gateway.stack import APP_NAME, LocalStack
from loadtest.bench.goodput import _client, cpu_name, send
from loadtest.bench.goodput_mix import TOKEN_IDS, Request
from loadtest.bench.goodput_score import Outcome
from loadtest.bench.stack_options import add_config_option, config_overrides
from loadtest.summary import percentile
from replica.backends.engines import engine_spec

ARMS = ("colocated", "split")
# per engine: (long prompt tokens, short prompt tokens, rate req/s); the bundled model on CPU
# computes a 1,500-token prompt in seconds, so its prompts are shorter and its rate lower
ENGINE_DEFAULTS = {"sim": ((1000, 2000), (32, 200), 4.0), "model": ((400, 800), (16, 128), 0.5)}
POLL_S = 2.0  # decode replicas' hand-over counts read this often (their latency list keeps the last 100)
KILL_POLL_S = 0.1  # a kill mark polls the prefill replicas' heartbeats this often for a busy one
ROUTE_CHECK = 4  # long and short prompts each in the route check
IDLE_WAIT_S = 60.0  # the longest wait for the prefill replicas' pools to show nothing in use


@dataclass
class Sent:
    """One request's outcome and the time it was sent (seconds into the run)."""

    outcome: Outcome
    prompt_tokens: int
    sent_s: float


@dataclass
class HandoverTally:
    """Decode replicas' hand-over counts summed, and every ok hand-over's seconds seen while polling."""

    counts: dict[str, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    last_error: str = ""


@dataclass
class ArmResult:
    arm: str
    requests: int = 0
    long: int = 0
    short: int = 0
    failed: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    short_ttft_p50_ms: float | None = None
    short_ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    output_tok_s: float = 0.0
    seconds: float = 0.0
    handover: dict[str, Any] | None = None  # split only
    route_check: dict[str, list[bool]] | None = None  # split only: prefill_from present, per prompt
    kills: list[dict[str, Any]] = field(default_factory=list)
    interrupted_recovered: int | None = None
    prefill_idle: dict[str, Any] | None = None


# ---- the workload ------------------------------------------------------------------------------
def workload(args: argparse.Namespace) -> list[tuple[float, Request]]:
    """Seeded Poisson arrivals over `--duration`, each long (past the threshold) or short."""
    rng = random.Random(args.seed)
    out, t = [], rng.expovariate(args.rate)
    while t < args.duration:
        long = rng.random() < args.long_share
        lo, hi = args.long_tokens if long else args.short_tokens
        prompt = tuple(rng.randrange(*TOKEN_IDS) for _ in range(rng.randint(lo, hi)))
        out.append((t, Request("long" if long else "short", prompt, args.max_tokens, None, -1)))
        t += rng.expovariate(args.rate)
    return out


async def open_loop(url: str, model: str, schedule: list[tuple[float, Request]]) -> tuple[list[Sent], float]:
    """Send each request at its offset and wait for all; (outcomes, seconds from the first send
    to the last end)."""
    async with _client() as http:
        start, tasks = time.perf_counter(), []

        async def one(offset: float, req: Request) -> Sent:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            return Sent(await send(http, url, model, req, {}), len(req.prompt), offset)

        tasks = [asyncio.create_task(one(o, r)) for o, r in schedule]
        done = list(await asyncio.gather(*tasks))
        return done, time.perf_counter() - start


# ---- the replicas, through Ray and Redis ---------------------------------------------------------
class Fleet:
    """An arm's replicas as the bench sees them: decode replicas' ids and counts (Redis' live
    heartbeats, then each replica's info() through Ray), prefill replicas' heartbeats and actors."""

    def __init__(self, redis_url: str, key_prefix: str) -> None:
        import redis
        from ray.serve._private.common import DeploymentID

        from gateway.app import REPLICA_NAME
        from replica.kv_io.kv_pull import ReplicaCaller
        from router.protocol.redis_schema import RedisKeys

        self.redis = redis.Redis.from_url(redis_url, decode_responses=True)
        self.keys, self.prefill_keys = RedisKeys(key_prefix), RedisKeys(f"{key_prefix}:prefill")
        self.decode = ReplicaCaller(DeploymentID(name=REPLICA_NAME, app_name=APP_NAME))
        self.prefill_deployment = DeploymentID(name=f"{REPLICA_NAME}-prefill", app_name=APP_NAME)
        self.killed: set[str] = set()  # their heartbeats outlive them by up to the publisher's TTL

    def beats(self, keys) -> dict[str, dict[str, str]]:
        """Live heartbeats (a dead replica's expires within the publisher's TTL) by replica id."""
        return {rid: hb for rid in self.redis.smembers(keys.replicas) if (hb := self.redis.hgetall(keys.heartbeat(rid)))}

    async def handover_stats(self) -> dict[str, dict]:
        """Each live decode replica's info()["stats"]["handover"]."""
        out = {}
        for rid in self.beats(self.keys):
            try:
                info = await self.decode.call(rid, "info")
            except Exception:  # gone since its heartbeat was read
                continue
            if "handover" in info["stats"]:
                out[rid] = info["stats"]["handover"]
        return out

    def busy_prefill(self) -> str | None:
        """The live prefill replica with the most work in hand by its heartbeat (None: all idle)."""
        beats = {rid: hb for rid, hb in self.beats(self.prefill_keys).items() if rid not in self.killed}

        def work(hb: dict[str, str]) -> int:
            return int(hb.get("pending_prefill_tokens", 0)) + 1000 * int(hb.get("running", 0))
        busy = {rid: w for rid, hb in beats.items() if (w := work(hb)) > 0}
        return max(busy, key=busy.__getitem__) if busy else None

    def kill_prefill(self, victim: str) -> bool:
        """Kill one prefill replica's actor (Serve starts another); False if it was gone."""
        import ray
        from ray.serve._private.common import ReplicaID
        from ray.serve._private.constants import SERVE_NAMESPACE

        try:
            actor = ray.get_actor(ReplicaID(victim, self.prefill_deployment).to_full_id_str(), namespace=SERVE_NAMESPACE)
            ray.kill(actor, no_restart=True)
        except ValueError:  # already gone
            return False
        self.killed.add(victim)
        return True


def add_counts(tally: HandoverTally, before: dict[str, dict], now: dict[str, dict]) -> None:
    """Fold the counts gained since `before` into `tally`, with the new ok hand-overs' seconds
    (the last `ok` gained of each replica's latency list, which holds its last 100)."""
    for rid, s in now.items():
        b = before.get(rid, {})
        for k in ("asked", "ok", "empty", "timeouts", "failed", "tokens", "bytes"):
            tally.counts[k] = tally.counts.get(k, 0) + s[k] - b.get(k, 0)
        new_ok = s["ok"] - b.get("ok", 0)
        if new_ok > 0:
            tally.latencies += s["latencies"][-new_ok:]
        tally.last_error = s.get("last_error") or tally.last_error


async def poll_handovers(fleet: Fleet, tally: HandoverTally, before: dict[str, dict], stop: asyncio.Event) -> None:
    """Read the decode replicas' counts every POLL_S until `stop`, then once more; `before`: the
    counts at the run's start."""
    while True:
        try:
            await asyncio.wait_for(stop.wait(), POLL_S)
        except TimeoutError:
            pass
        now = await fleet.handover_stats()
        add_counts(tally, before, now)
        before = {**before, **now}
        if stop.is_set():
            return


async def kill_loop(fleet: Fleet, every_s: float, until_s: float, kills: list[dict]) -> None:
    """A kill every `every_s` seconds of the arrivals' `until_s`, the first half an interval in
    (so a 300-s run at 60 s has 5, at 30, 90, ... 270 s): each kills a prefill replica with a
    hand-over in flight, the first busy one its heartbeats show, waited for up to half the
    interval (a kill of an idle replica interrupts nothing; none busy by then: no kill)."""
    start = time.perf_counter()
    t = every_s / 2
    while t < until_s:
        await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
        victim = None
        give_up = start + t + every_s / 2
        while victim is None and time.perf_counter() < give_up:
            victim = await asyncio.to_thread(fleet.busy_prefill)
            if victim is None:
                await asyncio.sleep(KILL_POLL_S)
        if victim is None:
            print(f"  no prefill replica busy within {every_s / 2:.0f} s of {t:.0f} s: no kill", flush=True)
        elif await asyncio.to_thread(fleet.kill_prefill, victim):
            kills.append({"at_s": round(time.perf_counter() - start, 1), "replica": victim})
            print(f"  killed prefill replica {victim} at {kills[-1]['at_s']} s", flush=True)
        else:
            print(f"  prefill replica {victim} was gone before its kill at {t:.0f} s", flush=True)
        t += every_s


async def run_split(url: str, model: str, schedule: list[tuple[float, Request]], fleet: Fleet,
                    args: argparse.Namespace, kills: list[dict]) -> tuple[list[Sent], float, HandoverTally]:
    """The split arm's run: the arrivals, with the counts polled and prefill replicas killed beside it."""
    tally, stop = HandoverTally(), asyncio.Event()
    poller = asyncio.create_task(poll_handovers(fleet, tally, await fleet.handover_stats(), stop))
    killer = (asyncio.create_task(kill_loop(fleet, args.kill_prefill_every, args.duration, kills))
              if args.kill_prefill_every else None)
    sent, seconds = await open_loop(url, model, schedule)
    if killer is not None:
        killer.cancel()
        await asyncio.gather(killer, return_exceptions=True)
    stop.set()
    await poller
    return sent, seconds, tally


def wait_prefill_idle(fleet: Fleet, timeout_s: float = IDLE_WAIT_S) -> dict[str, Any]:
    """Whether every live prefill replica's pool shows no block in use (free + cached ==
    capacity) once nothing runs, within `timeout_s`; the heartbeats as last read."""
    deadline = time.monotonic() + timeout_s
    while True:
        beats = {rid: hb for rid, hb in fleet.beats(fleet.prefill_keys).items() if rid not in fleet.killed}
        pools = {rid: {k: int(hb.get(k, 0)) for k in ("free_blocks", "cached_blocks", "capacity_blocks", "running")}
                 for rid, hb in beats.items()}
        idle = bool(pools) and all(p["free_blocks"] + p["cached_blocks"] == p["capacity_blocks"] and not p["running"]
                                   for p in pools.values())
        if idle or time.monotonic() > deadline:
            return {"ok": idle, "replicas": pools}
        time.sleep(1.0)


def route_check(url: str, model: str, args: argparse.Namespace) -> dict[str, list[bool]]:
    """A few long and short prompts, one at a time and not streamed: whether each response's
    route names a prefill replica."""
    rng = random.Random(args.seed + 1)
    out: dict[str, list[bool]] = {"long": [], "short": []}
    for cls in ("short", "long") * ROUTE_CHECK:
        lo, hi = args.long_tokens if cls == "long" else args.short_tokens
        body = {"model": model, "prompt": [rng.randrange(*TOKEN_IDS) for _ in range(rng.randint(lo, hi))],
                "max_tokens": 4, "ignore_eos": True, "temperature": 0}
        r = httpx.post(url, json=body, timeout=300)
        route = (r.json().get("prefixgate") or {}).get("route") or {} if r.status_code == 200 else {}
        out[cls].append("prefill_from" in route)
    return out


# ---- one arm -------------------------------------------------------------------------------------
def arm_config(args: argparse.Namespace, arm: str) -> AppConfig:
    roles = ({"prefill_replicas": args.prefill_replicas, "decode_replicas": args.decode_replicas} if arm == "split"
             else {"replicas": args.prefill_replicas + args.decode_replicas})
    base = dict(engine=args.engine, max_model_len=4096, pd_threshold_tokens=args.pd_threshold_tokens,
                redis_url="auto", key_prefix=f"pdbench-{arm}")
    if engine_spec(args.engine).default_num_blocks is not None:
        base["num_blocks"] = 4096  # an engine whose pool is counted in blocks, not sized from a model's memory
    return AppConfig(**{**base, **config_overrides(args), **roles})


def summarise(arm: str, sent: list[Sent], seconds: float) -> ArmResult:
    out = ArmResult(arm, requests=len(sent), seconds=round(seconds, 1))
    out.long = sum(s.outcome.cls == "long" for s in sent)
    out.short = out.requests - out.long
    for s in sent:
        code = s.outcome.failed or s.outcome.refused
        if code:
            out.failed += 1
            out.failures[code] = out.failures.get(code, 0) + 1
    ok = [s.outcome for s in sent if s.outcome.ttft_s is not None]
    out.ttft_p50_ms, out.ttft_p99_ms = (_ms(percentile([o.ttft_s for o in ok], q)) for q in (50, 99))
    short = [o.ttft_s for o in ok if o.cls == "short"]
    out.short_ttft_p50_ms, out.short_ttft_p99_ms = (_ms(percentile(short, q)) for q in (50, 99))
    out.tpot_p50_ms, out.tpot_p99_ms = (_ms(percentile([o.tpot_s for o in ok], q)) for q in (50, 99))
    out.output_tok_s = round(sum(o.tokens for o in ok) / seconds, 1) if seconds else 0.0
    return out


def handover_figures(tally: HandoverTally, long_sent: int) -> dict[str, Any]:
    c = tally.counts
    return {**c, "long_sent": long_sent,
            "routed_share": c.get("asked", 0) / long_sent if long_sent else None,  # given a prefill pick
            "handed_share": c.get("ok", 0) / long_sent if long_sent else None,  # K/V handed over
            "latency_p50_ms": _ms(percentile(tally.latencies, 50)), "latency_p99_ms": _ms(percentile(tally.latencies, 99)),
            "latencies_n": len(tally.latencies),
            "bytes_per_token": c.get("bytes", 0) / c["tokens"] if c.get("tokens") else None,
            "last_error": tally.last_error}


def pool_bytes_per_token(fleet: Fleet) -> int | None:
    """What one token's K/V occupies in a decode replica's pool (its heartbeat): on the sim
    engine, which moves no bytes, what its modelled hand-over moves per token."""
    beats = fleet.beats(fleet.keys)
    return max((int(hb.get("kv_bytes_per_token", 0)) for hb in beats.values()), default=None)


def run_arm(stack: LocalStack, args: argparse.Namespace, arm: str, schedule: list[tuple[float, Request]]) -> ArmResult:
    config = arm_config(args, arm)
    stack.deploy(config)
    model = httpx.get(f"{stack.url}/v1/models", timeout=10).json()["data"][0]["id"]
    url = f"{stack.url}/v1/completions"
    fleet = Fleet(config.redis_url, config.key_prefix)
    warm(url, model, fleet, arm, args)
    print(f"{arm}: {len(schedule)} requests over {args.duration:.0f} s", flush=True)
    if arm == "colocated":
        sent, seconds = asyncio.run(open_loop(url, model, schedule))
        return summarise(arm, sent, seconds)
    kills: list[dict] = []
    sent, seconds, tally = asyncio.run(run_split(url, model, schedule, fleet, args, kills))
    out = summarise(arm, sent, seconds)
    out.handover, out.kills = handover_figures(tally, out.long), kills
    out.handover["pool_kv_bytes_per_token"] = pool_bytes_per_token(fleet)
    out.interrupted_recovered = tally.counts.get("failed", 0) + tally.counts.get("timeouts", 0)
    out.prefill_idle = wait_prefill_idle(fleet)
    out.route_check = route_check(url, model, args)
    return out


def warm(url: str, model: str, fleet: Fleet, arm: str, args: argparse.Namespace) -> None:
    """A few requests before the run (not measured); on the split, until the prefill replicas
    heartbeat (the router picks none before)."""
    deadline = time.monotonic() + 120
    while arm == "split" and len(fleet.beats(fleet.prefill_keys)) < args.prefill_replicas:
        if time.monotonic() > deadline:
            raise RuntimeError("the prefill replicas never heartbeat")
        time.sleep(0.5)
    rng = random.Random(args.seed + 2)
    reqs = [Request(cls, tuple(rng.randrange(*TOKEN_IDS) for _ in range(rng.randint(*rng_range))), 4, None, -1)
            for cls, rng_range in (("long", args.long_tokens), ("short", args.short_tokens)) * 2]
    asyncio.run(open_loop(url, model, [(0.2 * i, r) for i, r in enumerate(reqs)]))


# ---- the report ------------------------------------------------------------------------------------
def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _f(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def format_table(results: list[ArmResult]) -> str:
    lines = [f"{'arm':<10} {'requests':>8} {'failed':>6} {'TTFT p50/p99 ms':>16} {'short TTFT p50/p99':>19} "
             f"{'TPOT p50/p99 ms':>16} {'out tok/s':>9}"]
    for r in results:
        lines.append(f"{r.arm:<10} {r.requests:>8} {r.failed:>6} {_f(r.ttft_p50_ms):>7}/{_f(r.ttft_p99_ms):<8} "
                     f"{_f(r.short_ttft_p50_ms):>9}/{_f(r.short_ttft_p99_ms):<9} "
                     f"{_f(r.tpot_p50_ms, '.1f'):>7}/{_f(r.tpot_p99_ms, '.1f'):<8} {r.output_tok_s:>9.1f}")
    for r in results:
        if r.handover is None:
            continue
        h = r.handover
        lines.append(f"split hand-overs: {h.get('asked', 0)} asked for {h['long_sent']} long prompts "
                     f"(routed {_f(_pct(h['routed_share']), '.0f')}%, handed over {_f(_pct(h['handed_share']), '.0f')}%); "
                     f"ok {h.get('ok', 0)}, empty {h.get('empty', 0)}, timeout {h.get('timeouts', 0)}, "
                     f"failed {h.get('failed', 0)}; time p50/p99 {_f(h['latency_p50_ms'])}/{_f(h['latency_p99_ms'])} ms "
                     f"(n={h['latencies_n']}); {h.get('tokens', 0)} tokens, {_f(h['bytes_per_token'], '.0f')} K/V bytes/token moved "
                     f"(pool: {h['pool_kv_bytes_per_token']} bytes/token)")
        if r.kills:
            lines.append(f"faults: {len(r.kills)} prefill replicas killed; interrupted hand-overs recovered "
                         f"{r.interrupted_recovered}; failed requests {r.failed}")
        lines.append(f"route check: long handed over {sum(r.route_check['long'])}/{len(r.route_check['long'])}, "
                     f"short {sum(r.route_check['short'])}/{len(r.route_check['short'])}; prefill pools idle with "
                     f"nothing in use: {r.prefill_idle['ok']} {r.prefill_idle['replicas']}")
    return "\n".join(lines)


def _pct(x: float | None) -> float | None:
    return None if x is None else 100 * x


# ---- the command ----------------------------------------------------------------------------------
def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    a, b = int(lo), int(hi or lo)
    if not 0 < a <= b:
        raise argparse.ArgumentTypeError(f"expected LO-HI tokens, got {text!r}")
    return a, b


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="prefixgate bench pd", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="sim", choices=tuple(ENGINE_DEFAULTS), help="sim: GPU service model; model: the bundled model")
    p.add_argument("--prefill-replicas", type=int, default=2, help="split arm's prefill replicas (colocated: P + D replicas)")
    p.add_argument("--decode-replicas", type=int, default=2, help="split arm's decode replicas")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals, req/s (default: 4 on sim, 0.5 on the model)")
    p.add_argument("--duration", type=float, default=90.0, help="seconds of arrivals per arm")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--long-share", type=float, default=0.3, help="share of long prompts (past the threshold)")
    p.add_argument("--long-tokens", type=_range, default=None, metavar="LO-HI",
                   help="long prompts' tokens (default: 1000-2000 on sim, 400-800 on the model)")
    p.add_argument("--short-tokens", type=_range, default=None, metavar="LO-HI",
                   help="short prompts' tokens (default: 32-200 on sim, 16-128 on the model)")
    p.add_argument("--pd-threshold-tokens", type=int, default=256, help="uncached prompt tokens past which a prompt is handed over")
    p.add_argument("--kill-prefill-every", type=float, default=None, metavar="S",
                   help="split arm: every S seconds (the first at S/2), kill a prefill replica with a hand-over in flight")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--port", type=int, default=8127)
    add_config_option(p, "time_scale=2")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    long_tokens, short_tokens, rate = ENGINE_DEFAULTS[args.engine]
    args.long_tokens, args.short_tokens = args.long_tokens or long_tokens, args.short_tokens or short_tokens
    args.rate = args.rate or rate
    if args.short_tokens[1] > args.pd_threshold_tokens or args.long_tokens[0] <= args.pd_threshold_tokens:
        p.error(f"short prompts must end at or under --pd-threshold-tokens ({args.pd_threshold_tokens}) and long ones start past it")
    if min(args.prefill_replicas, args.decode_replicas) < 1:
        p.error("--prefill-replicas and --decode-replicas must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = {k: v for k, v in vars(args).items() if k not in ("config", "json")}
    settings["config"] = config_overrides(args)
    print(f"CPU: {cpu_name()}\nsettings: {settings}", flush=True)
    schedule = workload(args)
    stack = LocalStack(arm_config(args, args.arms[0]), port=args.port)
    results: list[ArmResult] = []
    try:
        stack.start()
        for arm in args.arms:
            results.append(run_arm(stack, args, arm, schedule))
    finally:
        stack.stop()
    print(format_table(results), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cpu": cpu_name(), "settings": settings, "arms": {r.arm: asdict(r) for r in results}}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
