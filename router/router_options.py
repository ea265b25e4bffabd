"""Every option of our router, defined once, with its one default.

`PrefixGateRouter` (router/ray_router.py) is built from a RouterOptions (Serve passes the
fields as `request_router_kwargs`); the gateway's AppConfig takes its router fields and their
defaults from here (gateway/config.py), and so does the simulator (router/sim/router_config.py):
a knob tuned in simulation is the knob a config file deploys. Imports neither torch nor Ray.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from router.policy_table import DEFAULT_POLICY
from router.protocol.hashing import BLOCK_SIZE
from router.protocol.redis_schema import DEFAULT_KEY_PREFIX, INDEX_BUCKETS, LOOKUP_TIMEOUT_S

PUBLISH_DEPTH = 64  # leading blocks of a prompt that are hashed, published and matched
SESSION_TTL_S = 1800  # a session's last replica is remembered this long (sliding)
SAMPLED_REPLICAS = 4  # replicas scored for load alone, besides the matched and the session's
LOAD_REFRESH_S = 0.1  # the router's load table is re-read from the heartbeats this often
# uncached prompt tokens on the decode replica past which a prefill replica computes the prompt
# (router/prefill_pick.py; llm-d's prefix-based P/D decider rule)
PD_THRESHOLD_TOKENS = 256


@dataclass
class RouterOptions:
    policy: str = DEFAULT_POLICY  # a name or alias of router/registry.py
    policy_options: dict = field(default_factory=dict)  # the policy class's keyword arguments
    model_id: str = "SmolLM2-135M-Instruct"  # block-hash identity (the gateway passes the served model's)
    block_size: int = BLOCK_SIZE
    publish_depth: int = PUBLISH_DEPTH
    redis_url: str | None = None  # None: no index (consistent hashing on the session)
    key_prefix: str = DEFAULT_KEY_PREFIX
    redis_timeout_s: float = LOOKUP_TIMEOUT_S  # per lookup; then the decision goes on without the index
    session_ttl_s: int = SESSION_TTL_S
    seed: int | None = None
    sampled_replicas: int = SAMPLED_REPLICAS
    index_buckets: int = INDEX_BUCKETS  # must equal the replicas' (AppConfig passes one value to both)
    load_refresh_s: float = LOAD_REFRESH_S
    # LoRA: hash an adapter's prompts under its identity and price replicas by whether they hold
    # it; False routes every request as the base model's (as routers that do not know adapters do)
    lora_aware: bool = True
    # the live routing audit (router/protocol/audit_log.py): each router writes its decisions here
    audit_dir: str | None = None
    # prefill/decode roles (router/prefill_pick.py): the prefill replicas' own index (None: the
    # model's replicas do both), and the uncached prompt tokens past which one computes a prompt
    prefill_key_prefix: str | None = None
    pd_threshold_tokens: int = PD_THRESHOLD_TOKENS

    def __post_init__(self) -> None:
        if self.policy_options is None:
            self.policy_options = {}
        if self.publish_depth < 1 or self.sampled_replicas < 0 or self.index_buckets < 1:
            raise ValueError("publish_depth and index_buckets must be >= 1, sampled_replicas >= 0")
        if self.pd_threshold_tokens < 0:
            raise ValueError(f"pd_threshold_tokens must be >= 0, got {self.pd_threshold_tokens}")
        if self.load_refresh_s <= 0 or self.redis_timeout_s < 0:
            raise ValueError("load_refresh_s must be positive and redis_timeout_s >= 0 (0: every lookup times out)")

    def to_kwargs(self) -> dict:
        """As Serve's RequestRouterConfig passes them to `PrefixGateRouter.initialize_state`."""
        return asdict(self)
