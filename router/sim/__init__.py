"""Trace-driven simulator for routing policies.

Replays a request trace through N simulated replicas, each a real `BlockManager` run without
tensors and feeding a prefix index through the real KV event listener hook, routed by the real
policies of `router.policy`. Prefill and decode cost time through a small service model, so the
queues that load-aware routing reacts to exist. See docs/simulator.md.
"""

from router.costs.service import ServiceModel
from router.sim.engine import SimConfig, run_policy
from router.sim.workload import SimRequest

__all__ = ["ServiceModel", "SimConfig", "SimRequest", "run_policy"]
