"""What one replica runs, as the app builder passes it (a dict through Serve), and the backend
it names. Each backend imports its engine only in `create_backend`: a sim replica never loads
torch, and only a vLLM replica imports vLLM."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from replica.backends.engine_protocol import ENGINE_NAMES, EngineBackend
from replica.engine_config import EngineConfig
from router.protocol.messages import KV_PULL_TIMEOUT_S, STREAM_INTERVAL_S
from router.protocol.redis_schema import DEFAULT_KEY_PREFIX, INDEX_BUCKETS
from router.router_options import PUBLISH_DEPTH


@dataclass
class ReplicaSettings:
    engine: EngineConfig = field(default_factory=EngineConfig)
    redis_url: str | None = None  # None: run without publishing (routing falls back to hashing)
    key_prefix: str = DEFAULT_KEY_PREFIX
    index_buckets: int = INDEX_BUCKETS  # must equal the routers' (AppConfig passes one value to both)
    publish_depth: int = PUBLISH_DEPTH
    torch_threads: int = 1  # compute threads per replica (torch's, or vLLM's OMP threads)
    sim: dict | None = None  # SimEngineConfig fields: a simulated-compute replica (no model, no torch)
    kv_pull_timeout_s: float = KV_PULL_TIMEOUT_S  # a pull hint's round trip (docs/kv-pull.md); past it: recompute
    stream_interval_s: float = STREAM_INTERVAL_S  # a stream sends at most once per interval (replica/serve/stream_batcher.py)
    audit_dir: str | None = None  # the live routing audit: block events and outcomes go here (router/protocol/audit_log.py)
    vllm: dict | None = None  # VllmSettings fields: a replica running vLLM's engine (replica/backends/vllm_backend.py)

    @classmethod
    def from_dict(cls, d: dict) -> ReplicaSettings:
        d = dict(d)
        engine = EngineConfig(**d.pop("engine", {}))
        return cls(engine=engine, **d)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def engine_name(self) -> str:
        if self.sim is not None and self.vllm is not None:
            raise ValueError("a replica runs either the sim engine or vLLM, not both")
        return "sim" if self.sim is not None else "vllm" if self.vllm is not None else "model"


async def create_backend(settings: ReplicaSettings) -> EngineBackend:
    """The backend the settings name (replica/backends/engine_protocol.py)."""
    name = settings.engine_name
    assert name in ENGINE_NAMES
    if name == "vllm":
        from replica.backends.vllm_backend import VllmBackend, VllmSettings

        return await VllmBackend.create(settings.engine, VllmSettings(**settings.vllm), settings.torch_threads)
    if name == "sim":
        from replica.backends.local_backend import SimBackend

        return await SimBackend.create(settings.sim)
    from replica.backends.local_backend import ModelBackend

    return await ModelBackend.create(settings.engine, settings.torch_threads)
