"""The simulator's routing audit (router/sim/audit.py): known answers on small workloads, the
per-cause counts adding up to the gap, and the CLI option."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from replica.kvcache.block_manager import BlockTable
from router.costs.service import ServiceModel
from router.index.memory_index import InMemoryIndex
from router.policy import make_policy
from router.sim.audit import CAUSES, UNEXPLAINED, RoutingAudit, pooled_lru_per_request
from router.sim.engine import SimConfig, run_policy
from router.sim.oracle import pooled_lru_hits
from router.sim.replica import Job, SimReplica
from router.sim.router_config import SimRouterConfig
from router.sim.sim_router import SimClock, SimRouter
from router.sim.workload import ChatWorkload, SimRequest

BS = 16
ROOT = Path(__file__).resolve().parents[1]


def audited(requests, policy, config: SimConfig):
    audit = RoutingAudit(config.block_size, config.router.publish_depth)
    result = run_policy(requests, policy, config, audit)
    pooled = pooled_lru_per_request(requests, config.replicas * config.capacity_blocks)
    summary = audit.summarize(pooled, result.hit_blocks + result.pulled_blocks,
                              pooled_lru_hits(requests, config.replicas * config.capacity_blocks))
    return result, audit, summary


def test_routed_away_from_the_holder_by_load_is_load():
    """A prefix cached on one replica, then a burst of requests sharing it: the holder takes
    them until its queue outprices the miss elsewhere; the first request sent away loses the
    prefix (16 blocks) to `load`. The ones after it are queued behind that one on the other
    replica, so they find the prefix there (nothing more is lost)."""
    prefix = list(range(1, 17))
    requests = [SimRequest(0.0, prefix + [100], 17 * BS, 4)]
    requests += [SimRequest(5.0 + k * 1e-6, prefix + [200 + k], 17 * BS, 4) for k in range(10)]
    config = SimConfig(replicas=2, capacity_blocks=1000, block_size=BS)
    policy = make_policy("affinity", seed=0, balance_tolerance=0.0)  # no tie-break: cost alone
    result, audit, summary = audited(requests, policy, config)

    away = [r for r in audit.records if r.cause is not None]
    assert len(away) == 1
    (rec,) = away
    assert rec.cause == "load" and rec.best == 16 and rec.effective == 0
    assert rec.holder != rec.chosen and rec.seen[rec.holder] == 16 and rec.seen[rec.chosen] == 0
    assert rec.holder_cost > rec.costs[rec.chosen]  # it saw the match and priced the holder higher
    assert rec.lost_blocks == 16
    # pooled oracle: every burst request hits the prefix; the run: all but the one sent away
    assert summary.gap == 16 and result.hit_blocks == 9 * 16
    assert summary.causes == {"load": 16, UNEXPLAINED: 0}
    assert summary.to_dict()["causes_tokens"]["load"] == 16 * BS


def test_tie_break_away_from_the_holder_is_balance_or_load_by_its_cost():
    """Same burst, default tolerance: the cause follows the costs the policy saw."""
    prefix = list(range(1, 17))
    requests = [SimRequest(0.0, prefix + [100], 17 * BS, 4)]
    requests += [SimRequest(5.0 + k * 1e-6, prefix + [200 + k], 17 * BS, 4) for k in range(10)]
    config = SimConfig(replicas=2, capacity_blocks=1000, block_size=BS)
    policy = make_policy("affinity", seed=0)
    _, audit, summary = audited(requests, policy, config)
    away = [r for r in audit.records if r.cause is not None]
    assert away
    for rec in away:
        tolerance = policy.balance_tolerance * 17 * BS
        near = rec.holder_cost <= min(rec.costs.values()) + tolerance
        assert rec.cause == ("balance" if near else "load")
    assert summary.causes[UNEXPLAINED] == 0
    assert sum(summary.causes.values()) == summary.gap


def fleet(n: int, capacity: int = 64) -> tuple[dict[str, SimReplica], InMemoryIndex]:
    index = InMemoryIndex()
    return {f"r{i}": SimReplica(f"r{i}", capacity, BS, ServiceModel(), index) for i in range(n)}, index


def cache(rep: SimReplica, hashes: list[int]) -> None:
    table = BlockTable(hashes=list(hashes))
    rep.bm.allocate(table, len(hashes) * BS)
    rep.bm.commit(table, [], len(hashes) * BS, seed=0)
    rep.bm.free(table)


def decide_once(reps, index, config: SimRouterConfig, hashes: list[int], session: str | None = None,
                session_replica: str | None = None):
    router = SimRouter(make_policy("affinity", seed=0), reps, index, config, SimClock(1.0), audit=True)
    if session_replica is not None:
        router.index.remember_session(session, session_replica)
    audit = RoutingAudit(BS, config.publish_depth)
    req = SimRequest(1.0, hashes, len(hashes) * BS, 4, session)
    routed = router.decide(router.route_request(req.hashes, req.input_tokens, BS, session))
    return audit.decided(0, req, 1.0, routed, router.tap, list(reps.values()), router)


@pytest.mark.parametrize(("depth", "cause"), [(4, "depth_cap"), (64, "load")])
def test_depth_cap_or_load(depth, cause):
    """r0 holds 8 blocks of the prompt, r1 the first 4, r0 has a long queue. With a publish
    depth of 4 the router sees both at 4 and the extra 4 are lost to the cap; at 64 it sees r0's
    8 and still sends the request away: load."""
    prefix = list(range(1, 9))
    reps, index = fleet(2)
    cache(reps["r0"], prefix)
    cache(reps["r1"], prefix[:4])
    reps["r0"].queued_tokens = 10_000  # pending prefill: r0 is expensive
    rec = decide_once(reps, index, SimRouterConfig(publish_depth=depth), prefix + [99])
    assert (rec.chosen, rec.holder, rec.best, rec.effective) == ("r1", "r0", 8, 4)
    assert rec.cached == {"r0": 8, "r1": 4} and rec.seen["r0"] == min(8, depth)
    assert rec.cause == cause
    if depth < 8:  # seen at the cap, both are priced as reaching the prompt's last full block (9), r0 truly 8
        assert rec.holder_cost < rec.holder_cost_true


def test_index_down_hides_the_holder():
    """The lookup fails (degraded decision from the router's own memory, which never routed
    this prefix): the holder's cached blocks are not in the view: index_miss."""
    prefix = list(range(1, 9))
    reps, index = fleet(2)
    cache(reps["r0"], prefix)
    reps["r0"].queued_tokens = 100  # so the blind choice is r1
    rec = decide_once(reps, index, SimRouterConfig(index_down=1.0), prefix + [99])
    assert (rec.chosen, rec.reason, rec.holder, rec.seen) == ("r1", "stale", "r0", {"r0": 0, "r1": 0})
    assert rec.cause == "index_miss"


def test_prefix_still_computing_elsewhere_is_in_flight():
    """r0 is prefilling the same prompt head (queued, not cached), and no router marked it in
    flight: the policy sees no match anywhere and takes the idle r1."""
    prefix = list(range(1, 9))
    reps, index = fleet(2)
    reps["r0"].enqueue(Job(SimRequest(0.5, prefix + [50], 9 * BS, 4), 0.5, 9 * BS, 0))
    rec = decide_once(reps, index, SimRouterConfig(), prefix + [99])
    assert (rec.chosen, rec.holder, rec.cached, rec.prospective) == ("r1", "r0", {"r0": 0, "r1": 0}, {"r0": 8})
    assert rec.seen.get("r0", 0) == 0 and rec.cause == "in_flight"


def test_session_stickiness_is_session():
    """r0 holds 2 blocks of a mostly new prompt, the session's last replica r1 none: the
    session rule keeps r1 (its cost is within the slack), which the policy alone would not."""
    prefix = list(range(1, 3))
    reps, index = fleet(2)
    cache(reps["r0"], prefix)
    rec = decide_once(reps, index, SimRouterConfig(), prefix + list(range(50, 57)), "s1", "r1")
    assert (rec.chosen, rec.reason, rec.session_replica, rec.holder) == ("r1", "session", "r1", "r0")
    assert rec.cause == "session" and rec.best - rec.effective == 2


def chat() -> list[SimRequest]:
    return ChatWorkload(sessions=120, duration_s=60.0, think_s_mean=5.0).generate(seed=1)


@pytest.mark.parametrize(("policy", "router"), [
    ("affinity", SimRouterConfig()),
    ("affinity-pull", SimRouterConfig(publish_depth=6)),
    ("affinity", SimRouterConfig(index_down=0.3, sampled_replicas=1)),
    ("least-loaded", SimRouterConfig()),
])
def test_causes_add_up_to_the_gap(policy, router):
    """Under capacity pressure, every policy: the causes (each known) sum to pooled - run, the
    audit's totals are the simulator's and the oracle's, and `unexplained` is within 5%."""
    requests = chat()
    config = SimConfig(replicas=4, capacity_blocks=40, router=router, time_scale=2.0)
    result, audit, summary = audited(requests, make_policy(policy, seed=0), config)
    assert set(summary.causes) <= {*CAUSES, UNEXPLAINED}
    assert sum(summary.causes.values()) == summary.gap
    assert summary.gap == pooled_lru_hits(requests, 160) - (result.hit_blocks + result.pulled_blocks)
    assert abs(summary.causes[UNEXPLAINED]) <= 0.05 * abs(summary.gap)
    assert len(audit.records) == len(requests)
    assert sum(r.realized for r in audit.records if r.chosen) == result.hit_blocks + result.pulled_blocks
    # the per-request ceiling: the decision and after-decision causes alone
    routing = sum(n for c, n in summary.causes.items() if c not in ("capacity", "beats_pooled", "rejected"))
    assert routing == summary.decision_gap + summary.causes[UNEXPLAINED]
    assert summary.cached_ceiling <= summary.decision_ceiling


def test_audit_changes_nothing():
    requests = chat()
    for name in ("affinity", "affinity-pull"):
        config = SimConfig(replicas=4, capacity_blocks=40, time_scale=2.0)
        plain = run_policy(requests, make_policy(name, seed=0), config)
        with_audit, _, _ = audited(requests, make_policy(name, seed=0), config)
        assert with_audit.audit is None  # the CLI fills it in
        assert dataclasses.asdict(plain) == dataclasses.asdict(with_audit)


def test_cli_audit(tmp_path):
    out = tmp_path / "audit.jsonl"
    data = tmp_path / "sim.json"
    cmd = [sys.executable, "-m", "router.sim.cli", "--workload", "chat", "--limit", "400", "--replicas", "4",
           "--capacity", "40", "--policies", "affinity", "least-loaded", "--audit", "--audit-out", str(out),
           "--json", str(data)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("routing audit:") == 2
    assert "unexplained" in run.stdout and "lost hits" in run.stdout
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 2 * 400 and {line["policy"] for line in lines} == {"affinity", "least-loaded"}
    first = lines[0]
    assert set(first["cached"]) == {"r0", "r1", "r2", "r3"} and first["chosen"] in first["cached"]
    assert {"seen", "loads", "costs", "reason", "holder", "holder_cost", "holder_cost_true", "terms"} <= set(first)
    (setting,) = json.loads(data.read_text())["settings"]
    for row in setting["rows"]:
        audit = row["audit"]
        assert sum(audit["causes_blocks"].values()) == audit["gap_blocks"]
        assert abs(audit["causes_blocks"]["unexplained"]) <= 0.05 * max(abs(audit["gap_blocks"]), 1)
