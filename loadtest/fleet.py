"""Live trace replay against a stack of simulated-compute replicas, the simulator on the same rows,
and the policy comparison (`prefixgate loadtest trace|fleet`).

`run_fleet` brings up Redis, Ray and a Serve app of `--engine sim` replicas, then for each
replica count and policy deploys afresh (cold caches, a fresh Redis key prefix), replays the
same rows open-loop over HTTP, reads the replicas' step lag from their Redis heartbeats and the
routing decision time from the gateway's /metrics, runs the simulator on the same rows and
settings, and returns live and simulated results side by side.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.fleet_report import FleetResult, RunSettings, live_result, sim_result
from loadtest.trace_replay import ReplaySettings, replay
from router.costs.adapter_memory import LoraConfig
from router.costs.service import ServiceModel
from router.costs.transfer_model import TransferModel
from router.protocol.redis_schema import LOOKUP_TIMEOUT_S
from router.sim.cli import BASE_REPLICAS, capacity_blocks, make_transfer
from router.sim.lora import AdapterMix, adapter_identity
from router.sim.tiers import TierConfig
from router.sim.trace import load_rows, scale_rows, scale_service, scale_transfer, split_fitting
from router.sim.workload import SimRequest, distinct_blocks

MAX_STEP_LAG = 0.10  # a live run whose replicas fall further behind the model is invalid
MAX_FALLBACK = 0.02  # nor one whose routers decided this often without the index (Redis lookups
# timing out because the gateway process did not get the CPU: the machine, not the design)
# The default policies: a choice among the registry's names (tests check they are in it). `pow2`
# is ours now, served as simulated; docs/fleet.md's first-round `pow2` rows were Ray's (`ray-pow2`).
FLEET_POLICIES = ("affinity", "pow2", "random", "least-loaded", "ray-prefix")


@dataclass
class FleetSpec:
    trace: str
    start: int = 0
    requests: int = 1000
    replicas: list[int] = field(default_factory=lambda: [16])
    policies: list[str] = field(default_factory=lambda: list(FLEET_POLICIES))
    capacity: str = "tight"  # as in `prefixgate sim`: of the slice's distinct blocks
    block_size: int = 16
    max_output: int = 8
    load_scale: str = "auto"  # auto: replicas / 8, the simulator's default
    wall_scale: float = 1.0
    gateways: int = 1
    max_model_len: int = 4096
    seed: int = 0
    service: ServiceModel = field(default_factory=ServiceModel)
    # each replica's K/V tiers, as `prefixgate sim` takes them: blocks or a multiple of the pool ("4x")
    host_blocks: str = "0"
    disk_blocks: str = "0"
    host_rate: float = TransferModel.host_bytes_per_s  # bytes/s of a tier hit back into the pool
    disk_rate: float = TransferModel.disk_bytes_per_s
    # LoRA, as `prefixgate sim` takes it: sessions spread over adapters (none by default), each
    # replica's adapters in host memory, and whether the router hashes and prices them
    adapters: AdapterMix = field(default_factory=AdapterMix)
    lora: LoraConfig = field(default_factory=LoraConfig)
    lora_aware: bool = True

    def load_for(self, replicas: int) -> float:
        return replicas / BASE_REPLICAS if self.load_scale == "auto" else float(self.load_scale)


def workload(spec: FleetSpec) -> list[SimRequest]:
    """The slice's requests at the block size, their sessions under the adapter mix's adapters."""
    requests = scale_rows(load_rows(spec.trace, spec.start, spec.requests), spec.block_size, spec.max_output)
    return dataclasses.replace(spec.adapters, block_size=spec.block_size).apply(requests, spec.seed)


def adapter_names(spec: FleetSpec) -> dict[str, str]:
    """Each simulated adapter identity (router/sim/lora.py) -> the name the live stack serves it
    under: the same `lora-<i>` (the live digest is the generated directory's, so the identities
    differ; each side is consistent with itself)."""
    return {adapter_identity(i): f"lora-{i}" for i in range(spec.adapters.adapters)}


def build_adapters(spec: FleetSpec, where: Path) -> dict[str, str]:
    """PEFT adapters of the bundled model (rank 4, attention), one per simulated adapter, for the
    live stack to serve: the sim engine models their compute and memory, but a served adapter is
    a real directory, checked as any."""
    if not spec.adapters.adapters:
        return {}
    from loadtest.bench.lora_adapters import ATTENTION, make_adapter
    from replica.default_model import default_model_dir

    model = str(default_model_dir())
    return {name: make_adapter(model, str(where / name), ATTENTION, 4, seed=i)
            for i, name in enumerate(adapter_names(spec).values())}


def settings_for(spec: FleetSpec, requests: list[SimRequest], replicas: int) -> tuple[RunSettings, list[SimRequest], int]:
    cap = capacity_blocks(spec.capacity, distinct_blocks(requests))
    kept, dropped = split_fitting(requests, cap, spec.block_size, spec.max_model_len)
    tiers = TierConfig.from_flags(spec.host_blocks, spec.disk_blocks, cap)
    rates = {"host_bytes_per_s": spec.host_rate, "disk_bytes_per_s": spec.disk_rate}
    s = RunSettings(replicas=replicas, capacity_blocks=cap, block_size=spec.block_size,
                    load_scale=spec.load_for(replicas), wall_scale=spec.wall_scale, seed=spec.seed, tiers=tiers,
                    transfer=rates, lora=spec.lora, lora_aware=spec.lora_aware)
    return s, kept, dropped


# ---- reading the live stack ----------------------------------------------------------------------
def histogram_quantile(text: str, name: str, q: float) -> float | None:
    """Quantile of a Prometheus histogram from its exposition text (buckets summed over labels),
    linearly interpolated inside the bucket, as PromQL's histogram_quantile does."""
    buckets: dict[float, float] = {}
    pat = re.compile(rf'^{re.escape(name)}_bucket\{{(.*?)\}}\s+([0-9.eE+-]+)$')
    for line in text.splitlines():
        m = pat.match(line)
        if not m:
            continue
        le = re.search(r'le="([^"]+)"', m.group(1))
        if le:
            bound = math.inf if le.group(1) == "+Inf" else float(le.group(1))
            buckets[bound] = buckets.get(bound, 0.0) + float(m.group(2))
    if not buckets or buckets.get(math.inf, 0.0) <= 0:
        return None
    bounds = sorted(buckets)
    total = buckets[math.inf]
    rank = q * total
    prev_b, prev_c = 0.0, 0.0
    for b in bounds:
        c = buckets[b]
        if c >= rank:
            if math.isinf(b):
                return prev_b
            return prev_b + (b - prev_b) * ((rank - prev_c) / (c - prev_c) if c > prev_c else 0.0)
        prev_b, prev_c = b, c
    return prev_b


def decision_time(url: str) -> tuple[float | None, float | None]:
    """Routing decision p50/p99 (seconds) from the gateway's /metrics; (None, None) if absent."""
    import httpx

    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None, None
    name = "prefixgate_route_decision_seconds"
    return histogram_quantile(text, name, 0.5), histogram_quantile(text, name, 0.99)


def read_heartbeats(redis_url: str, key_prefix: str) -> list[dict[str, str]]:
    import redis

    from router.protocol.redis_schema import RedisKeys

    keys = RedisKeys(key_prefix)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        return [r.hgetall(keys.heartbeat(rid)) for rid in sorted(r.smembers(keys.replicas))]
    finally:
        r.close()


def worst_step_lag(heartbeats: list[dict[str, str]]) -> float | None:
    """Largest step lag any replica reports (field `step_lag`: actual / modelled step time - 1)."""
    lags = [float(hb["step_lag"]) for hb in heartbeats if hb.get("step_lag") not in (None, "")]
    return max(lags) if lags else None


# ---- the runs ------------------------------------------------------------------------------------
def app_config(spec: FleetSpec, s: RunSettings, policy: str, redis_url: str, key_prefix: str,
               adapters: dict[str, str] | None = None, lookup_s: float | None = None):
    """The Serve app of one live run: sim replicas running the trace's service model converted
    to the block size (the engine's step budget is its prefill chunk), sped up by the wall scale,
    with the simulator's pull model, K/V tiers and adapter memory (`adapters`: name -> directory,
    as `build_adapters` makes them; as many batch slots as resident adapters, since the
    simulator has no slot limit). `lookup_s`: the router's Redis lookup budget in wall seconds
    (default `lookup_budget_s`: production's)."""
    from gateway.config import AppConfig

    service = scale_service(spec.service, spec.block_size)
    overrides = {k: v for k, v in dataclasses.asdict(service).items() if k not in ("chunk_tokens", "max_running")}
    transfer = scale_transfer(make_transfer(spec.service, s.transfer), spec.block_size)  # copies, as the simulator's
    return AppConfig(
        engine="sim", sim_service=overrides, time_scale=spec.wall_scale, replicas=s.replicas, policy=policy,
        sim_transfer={"kv_bytes_per_token": transfer.kv_bytes_per_token, "pull_bytes_per_s": transfer.bytes_per_s,
                      "pull_fixed_s": transfer.fixed_s, "host_blocks": s.tiers.host_blocks,
                      "disk_blocks": s.tiers.disk_blocks, "kv_host_bytes_per_s": transfer.host_bytes_per_s,
                      "kv_disk_bytes_per_s": transfer.disk_bytes_per_s, "lora_load_ms": s.lora.load_ms},
        lora=dict(adapters or {}), max_cpu_loras=s.lora.max_cpu_loras, max_loras=s.lora.max_cpu_loras,
        lora_aware=s.lora_aware,
        redis_url=redis_url, key_prefix=key_prefix, block_size=spec.block_size, num_blocks=s.capacity_blocks,
        max_model_len=spec.max_model_len, max_num_seqs=service.max_running,
        max_num_batched_tokens=service.chunk_tokens, long_prefill_token_threshold=0,  # the service model's chunk
        seed=spec.seed, gateways=spec.gateways,
        default_max_tokens=spec.max_output, max_ongoing_requests=service.max_running,
        max_queued_requests=100_000, redis_timeout_s=lookup_s if lookup_s is not None else lookup_budget_s(spec.wall_scale),
        flow_control=False,  # the simulator has no gateway queue: requests reach the replicas as they arrive
    )


def lookup_budget_s(wall_scale: float) -> float:
    """The router's Redis lookup budget in wall seconds: the production 50 ms of model time, so
    stretched with the model when it runs slower than real time (a run at time scale 0.5 gives
    a lookup 100 ms, as it gives a prefill twice its modelled time); never shortened below 50 ms
    when the model runs faster, since the router's own CPU time does not shrink with it."""
    return LOOKUP_TIMEOUT_S / min(wall_scale, 1.0)


def live_run(url: str, spec: FleetSpec, s: RunSettings, policy: str, requests: list[SimRequest],
             redis_url: str | None = None, key_prefix: str | None = None) -> FleetResult:
    """Replays `requests` against the gateway at `url` and measures it."""
    rs = ReplaySettings(url=url, block_size=s.block_size, arrival_scale=s.load_scale * s.wall_scale, seed=s.seed,
                        adapter_names=adapter_names(spec))
    records = [r.to_dict() for r in replay(requests, rs)]
    hbs = read_heartbeats(redis_url, key_prefix) if redis_url and key_prefix else []
    result = live_result(policy, requests, records, s)
    result.step_lag = worst_step_lag(hbs)
    # decided without the index: "fallback" (no Redis configured, random's label) or "stale"
    fallback = (result.reasons.get("fallback", 0) + result.reasons.get("stale", 0)) / max(sum(result.reasons.values()), 1)
    result.valid = (result.step_lag is None or result.step_lag <= MAX_STEP_LAG) and (
        policy == "random" or fallback <= MAX_FALLBACK)  # random's every decision is "fallback"
    result.decision_p50_s, result.decision_p99_s = decision_time(url)
    return result


def _key_prefix(s: RunSettings, policy: str) -> str:
    return f"fleet-{uuid.uuid4().hex[:8]}-{s.replicas}-{policy}"


def run_one(stack, spec: FleetSpec, s: RunSettings, policy: str, requests: list[SimRequest],
            name: str | None = None, route_prefix: str = "/", adapters: dict[str, str] | None = None,
            key_prefix: str | None = None, lookup_s: float | None = None) -> FleetResult:
    """One live run on cold replicas: the app `name` is (re)deployed with a fresh Redis key
    prefix, so neither replica caches nor the index remember an earlier run."""
    from ray import serve

    from gateway.stack import APP_NAME

    name = name or APP_NAME
    prefix = key_prefix or _key_prefix(s, policy)
    config = app_config(spec, s, policy, stack.config.redis_url, prefix, adapters, lookup_s)
    t0 = time.time()
    if name in serve.status().applications:
        serve.delete(name)
    url = stack.deploy(config, name=name, route_prefix=route_prefix)
    print(f"[fleet] {s.replicas} sim replicas ({policy}) ready in {time.time() - t0:.0f}s", file=sys.stderr)
    return live_run(url, spec, s, policy, requests, stack.config.redis_url, prefix)


def run_fleet(spec: FleetSpec, on_pair: Callable[[FleetResult, FleetResult], None] | None = None,
              ray_address: str | None = None, redis_url: str = "auto") -> list[tuple[FleetResult, FleetResult]]:
    """Every (replica count, policy) live and simulated; fresh replicas for each live run."""
    import tempfile

    from gateway.local_redis import LocalRedis, free_port
    from gateway.stack import LocalStack

    requests = workload(spec)
    pairs: list[tuple[FleetResult, FleetResult]] = []
    stack = None
    _stop_on_sigterm()
    own_redis = LocalRedis().start() if redis_url in ("", "auto") else None  # stopped below, whatever happens
    redis_url = own_redis.url if own_redis else redis_url
    scratch = tempfile.TemporaryDirectory(prefix="fleet-adapters-")
    try:
        adapters = build_adapters(spec, Path(scratch.name))
        for n in spec.replicas:
            s, kept, dropped = settings_for(spec, requests, n)
            if dropped:
                print(f"[fleet] {dropped} of {len(requests)} rows do not fit {s.capacity_blocks} blocks: "
                      "dropped from both live and simulated runs", file=sys.stderr)
            for policy in spec.policies:
                if stack is None:  # Ray, Serve and Redis once, with the first run's app
                    t0 = time.time()
                    prefix = _key_prefix(s, policy)
                    stack = LocalStack(app_config(spec, s, policy, redis_url, prefix, adapters), port=free_port(),
                                       ray_address=ray_address).start()
                    print(f"[fleet] stack up with {n} sim replicas in {time.time() - t0:.0f}s", file=sys.stderr)
                    _stop_on_sigterm()  # after ray.init, which installs its own handler
                    live = live_run(stack.url, spec, s, policy, kept, stack.config.redis_url, prefix)
                else:
                    live = run_one(stack, spec, s, policy, kept, adapters=adapters)
                sim = sim_result(policy, kept, s, spec.service)
                pairs.append((live, sim))
                if on_pair:
                    on_pair(live, sim)
    finally:
        try:
            if stack is not None:
                stack.stop()
        finally:
            scratch.cleanup()
            if own_redis is not None:
                own_redis.cleanup()
    return pairs


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _stop_on_sigterm() -> None:
    """`timeout` or kill: raise in the main thread, so `run_fleet` stops what it started."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def save_json(pairs: list[tuple[FleetResult, FleetResult]], spec: FleetSpec, path: Path) -> None:
    import json

    d = dataclasses.asdict(spec)
    payload = {"spec": d, "runs": [{"live": a.to_dict(), "sim": b.to_dict()} for a, b in pairs]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
