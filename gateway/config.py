"""One dataclass of settings for the whole app: CLI flags, Serve config args and tests share it."""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field, fields

from router.protocol.redis_schema import LOOKUP_TIMEOUT_S


@dataclass
class AppConfig:
    model: str | None = None  # local HF model directory; None: bundled SmolLM2-135M-Instruct
    model_name: str | None = None  # served name (and block-hash identity); default: directory name
    replicas: int = 2
    policy: str = "affinity"  # affinity | affinity-pull | prefix | session | random | pow2 | ray-prefix | ray-session
    redis_url: str | None = "redis://127.0.0.1:6379/0"
    key_prefix: str = "prefixgate"
    block_size: int | None = None  # None: 32 on engine vllm (its CPU backend needs a multiple of 32), else 16
    num_blocks: int | None = None  # per replica; None: kv_cache_mb below
    kv_cache_mb: int = 512
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = 4096
    publish_depth: int = 64
    replica_num_cpus: float = 0.5
    replica_num_gpus: float = 0.0
    replica_resources: dict[str, float] = field(default_factory=dict)  # e.g. {"replica_node": 0.01}
    device: str = "cpu"
    torch_threads: int = 1
    max_ongoing_requests: int = 32  # per replica, in flight at once (Ray Serve's bound)
    max_queued_requests: int = 64  # beyond replicas * max_ongoing: 429 with Retry-After
    default_max_tokens: int = 256
    max_body_bytes: int = 4 * 2**20
    api_keys: dict[str, str] = field(default_factory=dict)  # API key -> tenant (each its own cache salt)
    redis_timeout_s: float = LOOKUP_TIMEOUT_S  # per routing lookup (50 ms); a lost connection or 3 timeouts in a row: Redis skipped for 1 s
    first_token_timeout_s: float = 300.0  # a request not routed/started by then gets a 504
    retry_attempts: int = 6  # replica calls per request when replicas fail (retry / stream migration)
    retry_budget_s: float = 90.0  # from a request's first replica failure: then 503 with Retry-After
    # Serve autoscaling_config for the replicas (min_replicas, max_replicas, target_ongoing_requests,
    # upscale_delay_s, downscale_delay_s, ...); when set it replaces `replicas` (infra/serve-autoscale.yaml)
    autoscaling: dict | None = None
    drain_timeout_s: float = 20.0  # a stopping replica's requests get this long to finish; the rest move on
    kv_pull_timeout_s: float = 5.0  # a replica acting on a pull hint waits this long for the holder, then computes
    session_ttl_s: int = 1800
    seed: int | None = None
    gateway_num_cpus: float = 0.25
    gateway_resources: dict[str, float] = field(default_factory=dict)  # e.g. {"head_node": 0.01}
    gateways: int = 1  # ingress replicas, each with its own router (they share only Redis)
    engine: str = "model"  # "model": our engine; "sim": simulated compute (no model, no torch); "vllm": vLLM's engine
    vllm: dict = field(default_factory=dict)  # vllm: VllmSettings overrides (replica/vllm_settings.py)
    vllm_python: str | None = None  # vllm: the replicas' interpreter; None: .venv-vllm beside the checkout
    time_scale: float = 1.0  # sim: run the service model this many times faster in wall time
    sim_service: dict[str, float] = field(default_factory=dict)  # sim: ServiceModel overrides
    sim_transfer: dict[str, float] = field(default_factory=dict)  # sim: pull model (SimEngineConfig kv_bytes_per_token, pull_*)
    sim_replica_num_cpus: float = 0.05  # sim: CPU reserved per replica (many fit on a core)

    @classmethod
    def from_dict(cls, d: dict | None) -> AppConfig:
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown settings: {sorted(unknown)}; valid: {sorted(known)}")
        if isinstance(d.get("redis_url"), str):  # Serve config files: redis://${HEAD_IP}:6379
            d["redis_url"] = os.path.expandvars(d["redis_url"])
            unset = re.findall(r"\$\{?(\w+)", d["redis_url"])
            if unset:  # e.g. a Ray head started without ~/.prefixgate/redis.env (docs/deploy.md)
                raise ValueError(f"redis_url names unset environment variables: {', '.join(unset)}")
        return cls(**d)

    def __post_init__(self) -> None:
        from replica.engine_protocol import ENGINE_NAMES

        if self.engine not in ENGINE_NAMES:
            raise ValueError(f"unknown engine {self.engine!r}; choose one of {', '.join(ENGINE_NAMES)}")
        if self.block_size is None:
            from replica.vllm_settings import VLLM_BLOCK_MULTIPLE

            self.block_size = VLLM_BLOCK_MULTIPLE if self.engine == "vllm" else 16

    def to_dict(self) -> dict:
        return asdict(self)
