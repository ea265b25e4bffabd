"""The live router's options, as the simulator takes them: same names, same defaults.

The defaults are RouterOptions' (router/router_options.py), where the live router's options
are defined once, so a knob tuned in simulation is the knob deployed.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.decider import STALE_MEMORY_S
from router.index.redis_index import RedisConfig
from router.protocol.redis_schema import INFLIGHT_TTL_S
from router.router_options import RouterOptions

_LIVE = RouterOptions()


@dataclass
class SimRouterConfig:
    """How the simulated router decides: the live router's options (first block) and how the
    simulator stands in for Redis (second block). The policy and its `policy_options` are
    chosen by whoever builds the policy (the CLI's --policies and --policy-opt)."""

    sampled_replicas: int = _LIVE.sampled_replicas  # scored for load besides the matched
    session_ttl_s: float = _LIVE.session_ttl_s  # Redis session key and router-local memory
    publish_depth: int = _LIVE.publish_depth  # leading blocks hashed and matched per prompt
    load_refresh_s: float = _LIVE.load_refresh_s  # load table refresh (with stale_loads)
    inflight_ttl_s: float = INFLIGHT_TTL_S  # in-flight marks and the router's in-flight memory
    stale_memory_s: float = STALE_MEMORY_S  # what a degraded (stale) decision remembers
    lookup_sample: int = RedisConfig.sample  # holders sampled where a match ends (Redis lookup)
    lookup_keep: int = RedisConfig.keep  # replicas one lookup reports at most
    lora_aware: bool = _LIVE.lora_aware  # adapters' prompts hashed and priced under their identity
    # Not in the live router: the live default seed is None (unseeded); a simulation is seeded
    # so that runs repeat
    seed: int | None = 0
    # the simulator's stand-ins: exact load (False) or a table refreshed every load_refresh_s
    # of simulated time (True); a lookup fails with this probability and the decision takes
    # the degraded path (`Decider.degraded`, labelled stale)
    stale_loads: bool = False
    index_down: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.index_down <= 1.0:
            raise ValueError(f"index_down must be a probability, got {self.index_down!r}")
        if self.publish_depth < 1 or self.sampled_replicas < 0:
            raise ValueError("publish_depth must be >= 1 and sampled_replicas >= 0")
        if self.stale_loads and self.load_refresh_s <= 0:
            raise ValueError("stale_loads needs a positive load_refresh_s")
