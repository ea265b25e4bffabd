"""The live routing audit: where a real run's cache hits were lost, request by request
(docs/routing-audit.md).

Reads the records a stack writes with `--audit-dir DIR` (router/protocol/audit_log.py): the
routers' decisions, the replicas' block events and outcomes. Replaying the block events in time
order gives what every replica really held when each decision was made; the replicas' outcomes
give what each request really hit. From there the accounting is the simulator's
(router/sim/audit.py): each request's gap to the pooled oracle telescopes into a fleet term
(pooled - best holder), a decision term (best holder - where it went, one cause per request)
and an after-decision term (where it went - what it hit), so the causes add up to the gap.

What differs from the simulator:
- Ground truth is the replicas' block events, stamped when each replica's listener saw them
  (vLLM's arrive a step or so after the blocks were computed); a prefix whose prefill had not
  finished is in flight on its replica from its decision until its first token.
- Hashes are the router's: the leading `publish_depth` blocks (a hit beyond them is not counted),
  and at most (prompt tokens - 1) // block size blocks can hit (the last prompt token is always
  computed), which caps every term.
- The pooled oracle is an LRU of the fleet's device blocks (the replicas' heartbeats), or
  unbounded when no capacity was seen.
- Two live causes: `stale` (the index did not answer within the lookup's deadline; the router
  decided from its own memory) and `overflow` (Ray placed the request on another replica than
  the policy chose: the chosen one was at max_ongoing_requests).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from router.protocol.audit_log import Blocks, Decision, Outcome, read_dir
from router.protocol.media import DEVICE
from router.sim.audit import AuditRecord, AuditSummary, RoutingAudit, pooled_lru_per_request


@dataclass
class _Held:
    """One replica's cached blocks, by medium, as its block events say."""

    media: dict[int, set[str]] = field(default_factory=dict)

    def apply(self, ev: Blocks) -> None:
        if ev.op == "0":
            self.media.clear()
        elif ev.op == "+":
            for h in ev.hashes:
                self.media.setdefault(h, set()).add(ev.medium)
        else:
            for h in ev.hashes:
                got = self.media.get(h)
                if got is not None:
                    got.discard(ev.medium)
                    if not got:
                        del self.media[h]

    def run(self, hashes: list[int], device_only: bool = False) -> int:
        n = 0
        for h in hashes:
            got = self.media.get(h)
            if not got or (device_only and DEVICE not in got):
                break
            n += 1
        return n


@dataclass
class _Request:
    """What `pooled_lru_per_request` replays: one request's hashes."""

    hashes: list[int]


@dataclass
class LiveAudit:
    audit: RoutingAudit
    summary: AuditSummary
    prompt_blocks: int  # the audited blocks of every prompt (leading publish_depth, hit-capped)
    decisions: int
    unmatched: int  # decisions with no outcome (failed, aborted, or the run stopped first)
    block_size: int
    pooled_capacity: int | None


def audit_dir(path: str | Path, block_size: int = 16, publish_depth: int | None = None,
              window: tuple[float, float] | None = None) -> LiveAudit:
    """The audit of the decisions in `path` (made within `window`, wall-clock seconds, if given:
    one client's run of several; block events outside it still count as what replicas held)."""
    decisions: list[Decision] = []
    outcomes: dict[str, Outcome] = {}
    events: list[Blocks] = []
    for rec in read_dir(path):
        if isinstance(rec, Decision):
            if window is None or window[0] <= rec.t <= window[1]:
                decisions.append(rec)
        elif isinstance(rec, Outcome):
            outcomes[rec.request_id] = rec
        else:
            events.append(rec)
    if not decisions:
        raise ValueError(f"{path}: no routing decisions recorded (was the stack started with --audit-dir {path}?)")
    decisions.sort(key=lambda d: d.t)
    events.sort(key=lambda e: e.t)
    depth = publish_depth or max(len(d.hashes) for d in decisions)
    capacity: dict[str, int] = {}
    for d in decisions:
        for rid, n in d.capacity.items():
            capacity[rid] = max(capacity.get(rid, 0), n)
    replicas = sorted({d.replica for d in decisions} | {e.replica for e in events} | set(capacity))
    held = {rid: _Held() for rid in replicas}
    inflight: dict[str, list[tuple[float, list[int]]]] = defaultdict(list)  # replica -> (prefill done at, hashes)
    audit = RoutingAudit(block_size, depth)
    kept: list[tuple[Decision, Outcome, int]] = []
    ei = unmatched = 0
    for d in decisions:
        out = outcomes.get(d.request_id)
        if out is None:
            unmatched += 1
            continue
        while ei < len(events) and events[ei].t <= d.t:
            held[events[ei].replica].apply(events[ei])
            ei += 1
        cap = min(len(d.hashes), max(d.prompt_tokens - 1, 0) // block_size)  # blocks that can hit
        hashes = d.hashes[:cap]
        pull = d.route.pull
        rec = AuditRecord(len(kept), d.t, cap, d.replica, d.route.reason, pull.replica_id if pull else None,
                          pull.num_blocks if pull else 0, d.session_replica)
        for rid in replicas:
            rec.cached[rid] = held[rid].run(hashes)
            flights = inflight[rid] = [f for f in inflight[rid] if f[0] > d.t]
            q = max((len(os.path.commonprefix([h, hashes])) for _, h in flights), default=0)
            if q > rec.cached[rid]:
                rec.prospective[rid] = q
        pros = {rid: max(n, rec.prospective.get(rid, 0)) for rid, n in rec.cached.items()}
        rec.seen = dict(d.seen)
        rec.loads = {rid: tuple(v) for rid, v in d.loads.items()}
        rec.costs = dict(d.costs)
        rec.best = max(pros.values(), default=0)
        rec.best_cached = max(rec.cached.values(), default=0)
        rec.effective = pros.get(d.replica, 0)
        if pull is not None and pull.num_blocks > 0 and pull.replica_id in held:
            rec.effective = max(rec.effective, min(pull.num_blocks, cap, held[pull.replica_id].run(hashes, device_only=True)))
        if rec.best > 0:
            holders = [rid for rid, n in pros.items() if n == rec.best]
            rec.holder = d.replica if d.replica in holders else max(holders, key=lambda r: (rec.seen.get(r, -1), r))
            rec.holder_cost = rec.costs.get(rec.holder)
        if rec.best > rec.effective:
            rec.cause = _classify(rec, d)
        rec.realized = min(out.cached_tokens // block_size, cap)
        audit.records.append(rec)
        kept.append((d, out, cap))
        # until its first token, this request's prefix is being computed on its replica
        done = out.first_token_t if out.first_token_t is not None else out.t
        inflight[d.replica].append((done, hashes))
    pooled_capacity = sum(capacity.values()) or None
    stream = [_Request(d.hashes[:cap]) for d, _, cap in kept]
    pooled = pooled_lru_per_request(stream, pooled_capacity if pooled_capacity else sys.maxsize)
    summary = audit.summarize(pooled)
    return LiveAudit(audit, summary, sum(cap for *_, cap in kept), len(decisions), unmatched, block_size,
                     pooled_capacity)


def _classify(rec: AuditRecord, d: Decision) -> str | None:
    """The decision term's cause, first rule that applies (router/sim/audit.py CAUSES)."""
    chosen, holder = rec.chosen, rec.holder
    if d.replica != d.route.replica_id:
        return "overflow"
    if d.route.reason == "stale":
        return "stale"
    if d.route.reason == "session":
        return "session"
    if d.route.reason == "slo":
        return "slo"
    seen_h, seen_c = rec.seen.get(holder), rec.seen.get(chosen, 0)
    if seen_h is not None and seen_h > seen_c:  # it saw the holder's longer match
        if d.route.pull is not None:
            return "pull_short"
        if d.cache_blind:
            return "blind"
        low = min(rec.costs.values()) if rec.costs else 0.0
        near = rec.costs.get(holder, float("inf")) <= low + d.balance_tokens
        return "balance" if near else "load"
    own_c = max(rec.cached.get(chosen, 0), rec.prospective.get(chosen, 0))
    if seen_c > own_c:
        return "index_stale"
    if (seen_h or 0) < rec.cached.get(holder, 0):
        return "index_miss"
    if (seen_h or 0) < rec.best:
        return "in_flight"
    return None


def report(result: LiveAudit) -> str:
    s = result.summary
    head = (f"routing audit: {result.decisions} decisions, {s.requests} with outcomes ({result.unmatched} without), "
            f"block size {result.block_size}, pooled oracle "
            + (f"LRU of {result.pooled_capacity} blocks" if result.pooled_capacity else "unbounded"))
    return head + "\n" + s.format(result.prompt_blocks)


def add_parser(sub) -> None:
    p = sub.add_parser("audit", help="the live routing audit of a run recorded with `prefixgate serve --audit-dir DIR`")
    p.add_argument("dir", type=Path, help="the --audit-dir of the run")
    p.add_argument("--block-size", type=int, default=16, help="the stack's block size")
    p.add_argument("--json", type=Path, default=None, help="write the summary here")
    p.add_argument("--records", type=Path, default=None, help="write one JSON line per request here")
    p.set_defaults(fn=cmd_audit)


def cmd_audit(args: argparse.Namespace) -> int:
    try:
        result = audit_dir(args.dir, args.block_size)
    except (ValueError, FileNotFoundError) as e:
        print(f"prefixgate loadtest audit: {e}", file=sys.stderr)
        return 2
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps({**result.summary.to_dict(), "decisions": result.decisions,
                                         "unmatched": result.unmatched, "prompt_blocks": result.prompt_blocks,
                                         "pooled_capacity": result.pooled_capacity}, indent=2) + "\n")
    if args.records:
        with open(args.records, "w") as f:
            result.audit.write_jsonl(f)
    return 0
