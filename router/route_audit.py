"""A routing decision as the live audit records it (router/protocol/audit_log.py `Decision`):
the decision itself (the RouteDecision the replica was sent), what the policy saw and priced,
and where the request went."""

from __future__ import annotations

from router.decider import Routed
from router.policy import AffinityPolicy, Policy
from router.protocol import audit_log
from router.slo_policy import SloPolicy


def decision_record(policy: Policy, routed: Routed, replica_id: str, request_id: str) -> audit_log.Decision:
    if isinstance(policy, SloPolicy):  # its costs and balance are today's policy's
        policy = policy.base
    route, decision, views = routed.route, routed.decision, routed.views
    affinity = isinstance(policy, AffinityPolicy)
    costs = policy.costs(route, views)  # recomputed from the kept views: only while auditing
    return audit_log.Decision(
        t=audit_log.now(), request_id=request_id, hashes=list(route.block_hashes),
        prompt_tokens=route.num_prompt_tokens, replica=replica_id, route=decision,
        session_replica=routed.session_replica,
        seen={v.replica_id: v.matched_blocks for v in views},
        loads={v.replica_id: [v.running, v.waiting, v.pending_prefill_tokens] for v in views},
        costs={rid: round(c, 1) for rid, c in costs.items()},
        balance_tokens=policy.balance_tolerance * route.num_prompt_tokens if affinity else 0.0,
        capacity={v.replica_id: v.capacity_blocks for v in views if v.capacity_blocks},
        cache_blind=not affinity,
        **_prefill_fields(routed),
    )


def _prefill_fields(routed: Routed) -> dict[str, object]:
    pick = routed.prefill
    if pick is None:
        return {}
    digits = 4 if pick.unit == "s" else 1
    return {"prefill_why": pick.why, "prefill_costs": {rid: round(c, digits) for rid, c in pick.costs.items()},
            "prefill_unit": pick.unit}
