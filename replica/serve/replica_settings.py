"""What one replica runs, as the app builder passes it through Serve (its msgspec builtins, a
dict), decoded and checked here when it enters the replica process. `engine` is exactly one
engine's settings (the tagged union of replica/backends/engines.py); its backend is imported
only in `create_backend`: a sim replica never loads torch, and only a vLLM replica imports vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from replica.backends import engines
from replica.backends.engine_protocol import EngineBackend
from replica.backends.engines import EngineSettings
from replica.backends.model_spec import ModelEngineSettings
from router.protocol.messages import HANDOVER_TIMEOUT_S, KV_PULL_TIMEOUT_S, STREAM_INTERVAL_S
from router.protocol.redis_schema import DEFAULT_KEY_PREFIX, INDEX_BUCKETS
from router.router_options import PUBLISH_DEPTH

ROLES = ("both", "prefill", "decode")


@dataclass
class ReplicaSettings:
    engine: EngineSettings = field(default_factory=ModelEngineSettings)  # the engine and its own settings
    redis_url: str | None = None  # None: run without publishing (routing falls back to hashing)
    key_prefix: str = DEFAULT_KEY_PREFIX
    index_buckets: int = INDEX_BUCKETS  # must equal the routers' (AppConfig passes one value to both)
    publish_depth: int = PUBLISH_DEPTH
    torch_threads: int = 1  # compute threads per replica (torch's, or vLLM's OMP threads)
    kv_pull_timeout_s: float = KV_PULL_TIMEOUT_S  # a pull hint's round trip (docs/kv-pull.md); past it: recompute
    stream_interval_s: float = STREAM_INTERVAL_S  # a stream sends at most once per interval (replica/serve/stream_batcher.py)
    audit_dir: str | None = None  # the live routing audit: block events and outcomes go here (router/protocol/audit_log.py)
    # prefill/decode roles (docs/prefill-decode.md): "both" (colocated), "prefill" or "decode"; a
    # decode replica asks the replicas of `prefill_deployment` (a deployment of the same app) for
    # hand-overs, each within `handover_timeout_s` (then it computes the prompt itself)
    role: str = "both"
    prefill_deployment: str | None = None
    handover_timeout_s: float = HANDOVER_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if (self.role == "decode") != (self.prefill_deployment is not None):
            raise ValueError("a decode replica needs prefill_deployment, and only a decode replica takes one")
        if not self.handover_timeout_s > 0:
            raise ValueError(f"handover_timeout_s must be > 0, got {self.handover_timeout_s}")

    @classmethod
    def from_dict(cls, d: dict) -> ReplicaSettings:
        """Decoded and type-checked (msgspec.ValidationError naming the field), the engine's
        settings by their tag."""
        return msgspec.convert(d, cls)

    def to_dict(self) -> dict:
        """What Serve passes to each replica: plain data, whichever interpreter the replica runs in."""
        return msgspec.to_builtins(self)


async def create_backend(settings: ReplicaSettings) -> EngineBackend:
    """The backend the settings name (replica/backends/engines.py picks it by their type)."""
    return await engines.create_backend(settings.engine, settings.torch_threads)

