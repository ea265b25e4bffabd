"""Routing audit: for every routed request, where it went, what every replica really held, what
the policy saw, and why hits were lost against the hit-rate ceilings (docs/simulator.md,
"Routing audit").

Per request, at decision time (before the request is queued anywhere):
- ground truth from each simulated replica's BlockManager (not the index the policy sees):
  `cached[r]`, the leading run of the prompt replica r would hit now (pool, plus lower tiers it
  reads back), and `prospective[r]`, the same once the prefills queued or running on r have
  completed (a replica's prefills run FIFO, so a request queued behind them finds their blocks);
- what the policy saw: the scored replicas' matched blocks (the lookup's answer plus the
  router's in-flight memory, capped at `publish_depth`), their loads and the policy's costs;
- the best holder: the replica with the longest prospective match, and what it would have cost.
At admission, `realized`: the blocks the request really hit (own cache and pulled).

Each request's gap to the pooled-LRU oracle (`pooled`, its hits when the oracle replays the
same stream) telescopes into three terms, so the per-cause counts add up to the gap exactly:

    pooled - realized = (pooled - best)                   fleet: capacity / beats_pooled
                      + (best - effective)                decision: one cause per request
                      + (effective - realized)            after the decision: evicted_queued / late_gain

`best` is the longest prospective match on any replica, `effective` the chosen replica's
prospective match, or the depth of the pull the decision named if deeper. The decision term
(> 0: another replica held, or was computing, a longer prefix than the chosen one got) is
classified by the first rule that applies (CAUSES, in order). Requests the fleet rejects lose
their oracle hits to `rejected`. `unexplained` is what no rule claims plus the difference
between these sums and the simulator's own totals, so it checks the bookkeeping too.

The summary also splits the decision term by the decision's route reason (`REASONS`, the one
list of them, `stale` included), so a loss can be read against what the router said it did.

Enabled per run (`run_policy(..., audit=RoutingAudit(...))`, CLI `--audit`); without it the
engine does no audit work at all.
"""

from __future__ import annotations

import json
import math
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import IO, Any

from router.policy import REASONS, AffinityPolicy, Policy, ReplicaView, RouteRequest
from router.protocol.messages import RouteDecision
from router.sim.workload import SimRequest

# cause -> meaning; the order is the classification's precedence within each term
CAUSES: dict[str, str] = {
    # fleet term: pooled - best
    "capacity": "the pooled LRU still held blocks that no replica held or was computing at decision time "
                "(evicted: split capacity, duplicated prefixes)",
    "beats_pooled": "(negative) a replica held more than the pooled LRU did: partitioned LRUs kept what one LRU evicted",
    "rejected": "oracle hits of requests too large for a replica (the simulator rejects them)",
    # decision term: best - effective
    "depth_cap": "the longer match lies past publish_depth, where the router does not look",
    "overflow": "(live) Ray placed the request on another replica than the policy chose (that one was at "
                "max_ongoing_requests)",
    "stale": "(live) the index did not answer within the lookup's deadline; the router decided from its own memory",
    "session": "session stickiness overrode the policy's own choice",
    "slo": "(live) the request's latency objectives moved it off the replica the policy would have chosen (that one "
           "was predicted to miss them), or no replica was predicted to meet them (router/slo_policy.py)",
    "load": "the policy saw the holder's longer match but priced it higher than the chosen replica by more "
            "than balance_tolerance (its queue)",
    "balance": "the holder was within balance_tolerance of the cheapest and lost the recent-work tie-break",
    "pull_short": "the policy chose a pull instead of the holder and the pull covered less than the holder held",
    "blind": "the policy saw the holder's longer match and ignores matches (cache-blind or hashing policy)",
    "index_stale": "the view credited the chosen replica with blocks it did not hold or compute "
                   "(in-flight memory or mark of a prefix since evicted)",
    "index_miss": "the holder's cached blocks were not in the view (lookup sampling, keep bound, not scored)",
    "in_flight": "the longer prefix was still being prefilled (or queued) on the holder, not cached, "
                 "and no in-flight mark showed it",
    # after the decision: effective - realized
    "evicted_queued": "blocks held at decision time were evicted from the chosen replica before the "
                      "request was admitted (a pull reads its source at arrival, the decision's instant)",
    "late_gain": "(negative) the request hit more at admission than any replica held at decision time",
}
FLEET_CAUSES = ("capacity", "beats_pooled", "rejected")
AFTER_CAUSES = ("evicted_queued", "late_gain")
DECISION_CAUSES = tuple(c for c in CAUSES if c not in FLEET_CAUSES + AFTER_CAUSES)
UNEXPLAINED = "unexplained"


def pooled_lru_per_request(requests: Sequence[SimRequest], capacity_blocks: int) -> list[int]:
    """`oracle.pooled_lru_hits`, per request (the same replay; the list sums to it)."""
    lru: OrderedDict[int, None] = OrderedDict()
    out = []
    for r in requests:
        hits = 0
        for h in r.hashes:
            if h not in lru:
                break
            hits += 1
        out.append(hits)
        for h in reversed(r.hashes):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return out


def held_run(bm, hashes: list[int]) -> tuple[int, int]:
    """(leading run in the device pool, leading run the replica would hit: pool, then the lower
    tiers it reads back), as `BlockManager._hit_run` walks it for a sequence with no token ids."""
    h2b = bm.hash_to_block
    n = 0
    for h in hashes:
        if h not in h2b:
            break
        n += 1
    device = n
    if bm.tiers:
        for h in hashes[n:]:
            if h not in h2b:
                tier = next((t for t in bm.tiers if h in t), None)
                if tier is None or not tier.promote:
                    break
            n += 1
    return device, n


def queued_run(rep, hashes: list[int]) -> int:
    """Longest leading run of `hashes` among the prompts queued or prefilling on `rep`: blocks it
    will hold once those prefills complete (before a request queued now is admitted)."""
    best = 0
    jobs: Iterable = rep.queue if rep.current is None else (rep.current, *rep.queue)
    for job in jobs:
        n = 0
        for a, b in zip(job.req.hashes, hashes, strict=False):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return best


class DecisionTap:
    """The policy as the Decider sees it, keeping the arguments and result of its last `decide`
    (the views the audit records). Everything else goes to the policy itself."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.last: tuple[RouteRequest, list[ReplicaView], str | None, RouteDecision] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)

    def decide(self, request, replicas, session_replica=None):
        decision = self.policy.decide(request, replicas, session_replica)
        self.last = (request, list(replicas), session_replica, decision)
        return decision


@dataclass(slots=True)
class AuditRecord:
    """One request, in blocks (tokens = blocks x block size)."""

    index: int  # position in the replayed stream
    arrival: float  # simulated (scaled) seconds
    blocks: int  # prompt blocks
    chosen: str | None = None  # None: rejected
    reason: str = ""
    pull_from: str | None = None
    pull_blocks: int = 0
    session_replica: str | None = None
    cached: dict[str, int] = field(default_factory=dict)  # ground truth, every replica
    prospective: dict[str, int] = field(default_factory=dict)  # where more than cached: in flight
    seen: dict[str, int] = field(default_factory=dict)  # the policy's view, scored replicas
    loads: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # running, waiting, pending tokens
    costs: dict[str, float] = field(default_factory=dict)  # the policy's cost of each scored replica
    holder: str | None = None  # longest prospective match (the chosen one on a tie)
    best: int = 0  # its prospective match
    best_cached: int = 0  # longest cached match on any replica
    effective: int = 0  # the chosen replica's prospective match, or the named pull's depth
    holder_cost: float | None = None  # the policy's cost for the holder (None: not scored)
    holder_cost_true: float | None = None  # its cost had the view shown its true match (uncapped)
    cause: str | None = None  # of the decision term, when > 0
    realized: int = -1  # hit at admission (own cache + pulled)
    pooled: int = 0  # the pooled-LRU oracle's hits for this request

    @property
    def lost_blocks(self) -> int:
        """Blocks by which another replica's cached prefix was longer than what the chosen one
        would serve (its own cache, what it was computing, or the pull the decision named)."""
        return max(self.best_cached - self.effective, 0) if self.chosen else 0

    def terms(self) -> dict[str, int]:
        """This request's gap to the pooled oracle, by cause (blocks; they sum to pooled - realized)."""
        if self.chosen is None:
            return {"rejected": self.pooled} if self.pooled else {}
        out: Counter[str] = Counter()
        fleet = self.pooled - self.best
        if fleet:
            out["capacity" if fleet > 0 else "beats_pooled"] += fleet
        decision = self.best - self.effective
        if decision:
            out[self.cause or UNEXPLAINED] += decision
        after = self.effective - self.realized
        if after:
            out["evicted_queued" if after > 0 else "late_gain"] += after
        return dict(out)

    def to_json(self, block_size: int) -> dict:
        d = {k: getattr(self, k) for k in self.__slots__}
        d["prospective"] = self.prospective
        d["loads"] = {rid: list(v) for rid, v in self.loads.items()}
        d["costs"] = {rid: round(c, 1) for rid, c in self.costs.items()}
        for k in ("holder_cost", "holder_cost_true"):
            if d[k] is not None:
                d[k] = round(d[k], 1)
        d["lost_blocks"] = self.lost_blocks
        d["terms"] = self.terms()
        d["block_size"] = block_size
        return d


class RoutingAudit:
    """Collects one run's records; `summarize` splits its gap to the ceilings by cause."""

    def __init__(self, block_size: int, publish_depth: int) -> None:
        self.block_size = block_size
        self.publish_depth = publish_depth
        self.records: list[AuditRecord] = []
        self._queued: dict[int, AuditRecord] = {}  # id(job) -> its record, until admitted

    # ---- the engine's hooks ------------------------------------------------------------------
    def rejected(self, index: int, req: SimRequest, now: float) -> None:
        self.records.append(AuditRecord(index, now, len(req.hashes)))

    def decided(self, index: int, req: SimRequest, now: float, routed, tap: DecisionTap, reps, router) -> AuditRecord:
        """Before the request is queued or committed: the fleet's state and the policy's view."""
        assert tap.last is not None, "the Decider did not call the policy"
        route, views, session_replica, raw = tap.last
        policy = tap.policy
        decision = routed.decision
        chosen, pull = decision.replica_id, decision.pull
        rec = AuditRecord(index, now, len(req.hashes), chosen, decision.reason, pull.replica_id if pull else None,
                          pull.num_blocks if pull else 0, session_replica)
        device: dict[str, int] = {}  # what a pull would read now: the pool's leading run
        for rep in reps:
            dev, use = held_run(rep.bm, req.hashes)
            q = queued_run(rep, req.hashes)
            rid = rep.replica_id
            rec.cached[rid] = use
            device[rid] = dev
            if q > use:
                rec.prospective[rid] = q
        pros = {rid: max(n, rec.prospective.get(rid, 0)) for rid, n in rec.cached.items()}
        rec.seen = {v.replica_id: v.matched_blocks for v in views}
        rec.loads = {v.replica_id: (v.running, v.waiting, v.pending_prefill_tokens) for v in views}
        rec.costs = policy.costs(route, views)
        rec.best = max(pros.values(), default=0)
        rec.best_cached = max(rec.cached.values(), default=0)
        rec.effective = pros[chosen]
        if pull is not None and pull.num_blocks > 0:
            rec.effective = max(rec.effective, min(pull.num_blocks, device.get(pull.replica_id, 0)))
        if rec.best > 0:
            holders = [rid for rid, n in pros.items() if n == rec.best]
            rec.holder = chosen if chosen in holders else max(
                holders, key=lambda r: (rec.seen.get(r, -1), -rec.costs.get(r, math.inf), r))
            rec.holder_cost = rec.costs.get(rec.holder)
            view = next((v for v in views if v.replica_id == rec.holder), None)
            if view is not None:  # its true match, past publish_depth too; its load as the policy saw it
                view = replace(view, matched_blocks=rec.best)
            else:
                view = router.view(rec.holder, rec.best)
            # priced on the whole prompt's hashes: the true match, not one assumed past the depth
            rec.holder_cost_true = policy.cost(replace(route, block_hashes=req.hashes), view)
        if rec.best > rec.effective:
            rec.cause = self._classify(rec, policy, route, views, session_replica, raw)
        return rec

    def enqueued(self, job, rec: AuditRecord) -> None:
        self.records.append(rec)
        self._queued[id(job)] = rec

    def admitted(self, job) -> None:
        rec = self._queued.pop(id(job))
        rec.realized = job.hit_blocks + job.pulled_blocks

    # ---- classification ----------------------------------------------------------------------
    def _classify(self, rec: AuditRecord, policy: Policy, route: RouteRequest, views: list[ReplicaView],
                  session_replica: str | None, raw: RouteDecision) -> str | None:
        depth = self.publish_depth
        if min(rec.best, depth) <= min(rec.effective, depth):
            return "depth_cap"
        chosen, holder = rec.chosen, rec.holder
        if raw.reason == "session" and session_replica == chosen:
            state = policy.rng.getstate()
            alone = policy.decide(route, views, None)  # what it would have done without the session
            policy.rng.setstate(state)
            if alone.replica_id != chosen:
                return "session"
        seen_h = rec.seen.get(holder)
        seen_c = rec.seen.get(chosen, 0)
        if seen_h is not None and seen_h > seen_c:  # it saw the holder's longer match
            if rec.pull_from is not None:
                return "pull_short"
            if not isinstance(policy, AffinityPolicy):
                return "blind"
            low = min(rec.costs.values())
            near = rec.costs[holder] <= low + policy.balance_tolerance * route.num_prompt_tokens
            return "balance" if near else "load"
        own_c = max(rec.cached[chosen], rec.prospective.get(chosen, 0))
        if seen_c > min(own_c, depth):
            return "index_stale"
        seen_h = seen_h or 0
        if seen_h < min(rec.cached[holder], depth):
            return "index_miss"
        if seen_h < min(rec.best, depth):
            return "in_flight"
        return None

    # ---- summary -----------------------------------------------------------------------------
    def summarize(self, pooled: Sequence[int], run_hits: int | None = None,
                  pooled_hits: int | None = None) -> AuditSummary:
        """`pooled`: the oracle's hits per request of the replayed stream (`pooled_lru_per_request`
        at the setting's capacity). `run_hits` / `pooled_hits`: the simulator's own totals (the
        result's hit + pulled blocks, `oracle.pooled_lru_hits`) the gap is taken from; default
        the audit's sums."""
        assert not self._queued, "requests still queued: summarize after the run"
        causes: Counter[str] = Counter()
        requests: Counter[str] = Counter()
        reasons: Counter[str] = Counter()
        reason_blocks: Counter[str] = Counter()
        realized = best = best_cached = lost = lost_requests = 0
        for rec in self.records:
            rec.pooled = pooled[rec.index]
            for cause, n in rec.terms().items():
                causes[cause] += n
                requests[cause] += 1
            if rec.chosen is not None:
                if rec.reason not in REASONS:
                    raise ValueError(f"route reason {rec.reason!r} is not in router.policy.REASONS {REASONS}")
                reasons[rec.reason] += 1
                reason_blocks[rec.reason] += rec.best - rec.effective
                realized += rec.realized
                best += rec.best
                best_cached += rec.best_cached
                if rec.lost_blocks:
                    lost += rec.lost_blocks
                    lost_requests += 1
        pooled_total = sum(pooled[r.index] for r in self.records)
        run_hits = realized if run_hits is None else run_hits
        pooled_hits = pooled_total if pooled_hits is None else pooled_hits
        gap = pooled_hits - run_hits
        named = {c: causes[c] for c in CAUSES if causes[c]}
        named[UNEXPLAINED] = gap - sum(named.values())  # what no rule claims, and any bookkeeping residual
        return AuditSummary(
            block_size=self.block_size, requests=len(self.records), pooled_hits=pooled_hits, run_hits=run_hits,
            decision_ceiling=best, cached_ceiling=best_cached, gap=gap, causes=named,
            cause_requests={c: requests[c] for c in named if requests[c]},
            lost_requests=lost_requests, lost_blocks=lost,
            reasons={r: reasons[r] for r in REASONS if reasons[r]},
            reason_blocks={r: reason_blocks[r] for r in REASONS if reasons[r]},
        )

    def write_jsonl(self, out: IO[str], **context: Any) -> None:
        """One JSON line per request, with `context` (policy, setting) in every line."""
        for rec in self.records:
            out.write(json.dumps({**context, **rec.to_json(self.block_size)}, separators=(",", ":")) + "\n")


@dataclass
class AuditSummary:
    """One run's gap to its ceilings, by cause, in blocks (x block_size for tokens)."""

    block_size: int
    requests: int
    pooled_hits: int  # pooled-LRU oracle
    run_hits: int  # realized: own cache + pulled
    decision_ceiling: int  # sum over requests of the best replica's match at decision time, in flight included
    cached_ceiling: int  # the same, cached blocks only
    gap: int  # pooled_hits - run_hits
    causes: dict[str, int]  # cause -> blocks; sums to gap, `unexplained` included
    cause_requests: dict[str, int]  # requests contributing to each cause
    lost_requests: int  # requests where another replica held a longer cached prefix than the chosen one
    lost_blocks: int  # ... and by how many blocks in all
    # routed requests per route reason (REASONS order), and their decision term (best - effective)
    reasons: dict[str, int] = field(default_factory=dict)
    reason_blocks: dict[str, int] = field(default_factory=dict)

    @property
    def decision_gap(self) -> int:
        """The gap to the per-request ceiling (best replica at decision time): the decision and
        after-decision causes alone."""
        return self.decision_ceiling - self.run_hits

    def tokens(self, blocks: int) -> int:
        return blocks * self.block_size

    def to_dict(self) -> dict:
        return {
            "block_size": self.block_size, "requests": self.requests, "pooled_hits": self.pooled_hits,
            "run_hits": self.run_hits, "decision_ceiling": self.decision_ceiling,
            "cached_ceiling": self.cached_ceiling, "gap_blocks": self.gap, "gap_tokens": self.tokens(self.gap),
            "decision_gap_blocks": self.decision_gap,
            "causes_blocks": self.causes, "causes_tokens": {c: self.tokens(n) for c, n in self.causes.items()},
            "cause_requests": self.cause_requests,
            "lost_requests": self.lost_requests, "lost_blocks": self.lost_blocks,
            "reasons": self.reasons, "reason_decision_tokens": {r: self.tokens(n) for r, n in self.reason_blocks.items()},
        }

    def format(self, prompt_blocks: int) -> str:
        """The per-cause table: tokens, share of the pooled gap, share of the decision-time gap."""
        def pct(n: int, of: int) -> str:
            return f"{n / of:>8.1%}" if of else f"{'-':>8}"

        def pts(n: int) -> str:
            return f"{n / prompt_blocks:.2%}" if prompt_blocks else "-"

        lines = [
            f"  ceilings (blocks): pooled LRU {self.pooled_hits} ({pts(self.pooled_hits)}), best replica at decision "
            f"{self.decision_ceiling} ({pts(self.decision_ceiling)}; cached only {self.cached_ceiling}), "
            f"run {self.run_hits} ({pts(self.run_hits)})",
            f"  gap to pooled {self.tokens(self.gap):,} tokens ({self.gap} blocks, {pts(self.gap)} of prompt); "
            f"to best-at-decision {self.tokens(self.decision_gap):,} tokens ({self.decision_gap} blocks)",
            f"  {'cause':<16}{'tokens':>12}{'% gap':>8}{'% dec':>8}{'requests':>10}",
        ]
        for cause, n in self.causes.items():
            dec = pct(n, self.decision_gap) if cause not in FLEET_CAUSES and cause != UNEXPLAINED else f"{'':>8}"
            lines.append(f"  {cause:<16}{self.tokens(n):>12,}{pct(n, self.gap)}{dec}"
                         f"{self.cause_requests.get(cause, 0):>10}")
        lines.append(f"  lost hits (another replica held a longer cached prefix than the chosen): "
                     f"{self.lost_requests} requests, {self.tokens(self.lost_blocks):,} tokens")
        if self.reasons:
            by_reason = ", ".join(f"{r} {n} ({self.tokens(self.reason_blocks.get(r, 0)):,})"
                                  for r, n in self.reasons.items())
            lines.append(f"  by route reason, requests (decision-term tokens): {by_reason}")
        return "\n".join(lines)
