"""The simulator routes through the live router's decision path (router/sim/sim_router.py):
the same Decider, lookup semantics, memories and options, on simulated time and exact state."""

from __future__ import annotations

import asyncio
import time

import pytest

from replica.kvcache.block_manager import BlockTable
from router.costs.service import ServiceModel
from router.decider import Decider, InflightPrefixes, SessionMemory
from router.index.memory_index import InMemoryIndex
from router.index.redis_index import RedisConfig, RedisIndex
from router.load_table import LoadTable
from router.policy import make_policy
from router.router_options import RouterOptions
from router.sim.cli import build_parser, router_config
from router.sim.engine import SimConfig, run_policy
from router.sim.index import SimIndex
from router.sim.replica import SimReplica
from router.sim.router_config import SimRouterConfig
from router.sim.sim_router import SimClock, SimRouter
from router.sim.workload import ChatWorkload

BS = 16


def fleet(n: int, capacity: int = 64) -> tuple[dict[str, SimReplica], InMemoryIndex]:
    index = InMemoryIndex()
    reps = {f"r{i}": SimReplica(f"r{i}", capacity, BS, ServiceModel(), index) for i in range(n)}
    return reps, index


def cache(rep: SimReplica, hashes: list[int]) -> None:
    """The replica computed and released this prompt: its blocks are cached (and indexed)."""
    table = BlockTable(hashes=list(hashes))
    rep.bm.allocate(table, len(hashes) * BS)
    rep.bm.commit(table, [], len(hashes) * BS, seed=0)
    rep.bm.free(table)


def sim_router(reps, index, policy: str = "affinity", **options) -> SimRouter:
    return SimRouter(make_policy(policy, seed=0), reps, index, SimRouterConfig(**options), SimClock(1.0))


def test_defaults_are_the_live_routers():
    from router.ray_router import PrefixGateRouter

    live = PrefixGateRouter.__new__(PrefixGateRouter)
    live.initialize_state()  # no Redis URL: nothing connects
    config = SimRouterConfig()
    for name in ("sampled_replicas", "session_ttl_s", "publish_depth", "load_refresh_s"):
        assert getattr(config, name) == getattr(live.options, name) == getattr(RouterOptions(), name)
    assert (config.lookup_sample, config.lookup_keep) == (RedisConfig.sample, RedisConfig.keep)
    # the CLI's defaults are the config's, and its flags reach the config
    assert router_config(build_parser().parse_args([])) == config
    args = build_parser().parse_args(["--sampled-replicas", "7", "--session-ttl-s", "5", "--index-down", "0.5",
                                      "--stale-loads", "--seed", "3"])
    got = router_config(args)
    assert (got.sampled_replicas, got.session_ttl_s, got.index_down, got.stale_loads, got.seed) == (7, 5.0, 0.5, True, 3)


def test_simulated_decision_equals_the_deciders():
    """Same state, same seeds: the simulator's decision is the one a live Decider makes from a
    load table holding the same heartbeats and the same lookup answer."""
    reps, index = fleet(12)
    for i, rep in enumerate(reps.values()):
        cache(rep, [1, 2, 3][: 1 + i % 3])  # every replica holds block 1, some more
        rep.queue.extend([None] * (i % 4))  # queued requests: load differs between replicas
        rep.queued_tokens = 100 * (i % 4)
    router = sim_router(reps, index)
    route = router.route_request([1, 2, 3, 9], 4 * BS, BS, None)
    look = SimIndex(index, router.clock, seed=0).lookup(route.block_hashes)  # the answer it will get
    routed = router.decide(route)

    table = LoadTable(RedisIndex(RedisConfig("redis://127.0.0.1:1/0")), refresh_s=60.0, seed=0)
    table._loads = {rid: rep.heartbeat(1.0) for rid, rep in reps.items()}
    table.updated_at = time.monotonic()
    live = Decider(make_policy("affinity", seed=0), table, InflightPrefixes(20.0), 4, SessionMemory())

    async def decide():
        try:
            return live.score(route, list(reps), look, lambda rid: reps[rid].queue_len())
        finally:
            await table.close()

    expected = asyncio.run(decide())
    assert routed.decision == expected.decision
    assert routed.ranked == expected.ranked and routed.matched == expected.matched
    # the lookup is the live one's, sampled: 4 holders at most where a match ends, not all 12
    assert len(look.replicas) < 12 and max(e.matched_blocks for e in look.replicas.values()) == 3


def test_lookup_answers_like_redis():
    """Holder counts, in-flight marks where nobody holds a block, sampling and `keep`."""
    reps, index = fleet(8)
    for rid in ("r0", "r1"):
        cache(reps[rid], [1, 2, 3])
    for rid in ("r2", "r3", "r4", "r5", "r6", "r7"):
        cache(reps[rid], [1])
    clock = SimClock(0.0)
    exact = SimIndex(index, clock, sample=100, keep=100)
    assert {r: e.matched_blocks for r, e in exact.lookup([1, 2, 3, 4]).replicas.items()} == {
        rid: n for rid, n in index.match([1, 2, 3, 4], list(reps)).items() if n}
    sampled = SimIndex(index, clock, sample=2, keep=12).lookup([1, 2, 3])
    depths = sorted(e.matched_blocks for e in sampled.replicas.values())
    assert depths.count(3) == 2 and depths.count(1) <= 2  # at most 2 drawn per level
    exact.mark_inflight([4, 5], "r1", ttl_s=10.0)  # block 4: nobody holds it, r1 was just sent it
    assert exact.lookup([1, 2, 3, 4, 5]).replicas["r1"].matched_blocks == 5
    clock.now = 11.0  # the mark expired
    assert exact.lookup([1, 2, 3, 4, 5]).replicas["r1"].matched_blocks == 3


def test_sampled_replicas_changes_what_is_scored():
    reps, index = fleet(16)
    cold = [100, 101]  # nobody holds it: only the sampled replicas are scored
    for k in (1, 3, 6):
        routed = sim_router(reps, index, sampled_replicas=k).decide(sim_router(reps, index).route_request(cold, 40, BS, None))
        assert len(routed.ranked) == k
    assert len(sim_router(reps, index, "least-loaded", sampled_replicas=1).decide(
        sim_router(reps, index).route_request(cold, 40, BS, None)).ranked) == 16  # cache-blind: all
    # and it reaches the whole simulation: the decisions differ
    requests = ChatWorkload(sessions=60, duration_s=120.0, think_s_mean=5.0).generate(seed=2)
    runs = [run_policy(requests, make_policy("affinity", seed=0),
                       SimConfig(replicas=16, capacity_blocks=80, router=SimRouterConfig(sampled_replicas=k)))
            for k in (0, 8)]
    assert runs[0].reasons != runs[1].reasons or runs[0].hit_blocks != runs[1].hit_blocks


def test_inflight_prefix_keeps_a_new_prompt_together():
    """A second request for a prefix nobody has computed yet follows the first (in-flight)."""
    reps, index = fleet(8)
    router = sim_router(reps, index)
    route = router.route_request([50, 51, 52], 3 * BS + 1, BS, None)
    first = router.decide(route)
    router.routed(first, first.decision.replica_id)
    second = router.decide(router.route_request([50, 51, 52], 3 * BS + 1, BS, None))
    assert second.decision.replica_id == first.decision.replica_id
    assert second.matched[first.decision.replica_id] == 3 and second.decision.reason == "prefix"


def test_session_paths_index_and_router_memory():
    """The session's replica comes from the index's session key, or, when the lookup fails,
    from the router's own session memory; both expire on the simulated clock."""
    reps, index = fleet(8)
    for down, reason in ((0.0, "session"), (1.0, "stale")):
        router = sim_router(reps, index, index_down=down, session_ttl_s=100.0)
        first = router.decide(router.route_request([7], BS + 1, BS, "chat-1"))
        home = first.decision.replica_id
        router.routed(first, home)
        assert router.decider.sessions.get("chat-1") == home
        for turn in range(5):  # new blocks each turn: only the session ties them to `home`
            routed = router.decide(router.route_request([200 + turn], BS + 1, BS, "chat-1"))
            assert routed.decision.replica_id == home and routed.decision.reason == reason
        assert router.degraded == (6 if down else 0)
        router.clock.now += 101.0
        assert router.decider.sessions.get("chat-1") is None and router.index.session("chat-1") is None


def test_stale_loads_refresh_on_the_simulated_clock():
    reps, index = fleet(2)
    router = sim_router(reps, index, stale_loads=True, load_refresh_s=0.5)
    router.loads.sync()
    reps["r0"].queue.append(None)
    router.clock.now += 0.2
    router.loads.sync()
    assert router.loads.get("r0")["waiting"] == 0  # not refreshed yet
    router.clock.now += 0.4
    router.loads.sync()
    assert router.loads.get("r0")["waiting"] == 1
    exact = sim_router(reps, index)
    exact.loads.sync()
    assert exact.loads.get("r0")["waiting"] == 1


def test_degraded_simulation_runs_and_labels_stale():
    requests = ChatWorkload(sessions=40, duration_s=60.0, think_s_mean=3.0).generate(seed=4)
    result = run_policy(requests, make_policy("affinity", seed=0),
                        SimConfig(replicas=4, capacity_blocks=200, router=SimRouterConfig(index_down=1.0)))
    assert set(result.reasons) == {"stale"} and result.hit_blocks > 0


def test_config_rejects_nonsense():
    with pytest.raises(ValueError):
        SimRouterConfig(index_down=2.0)
    with pytest.raises(ValueError):
        SimRouterConfig(publish_depth=0)
