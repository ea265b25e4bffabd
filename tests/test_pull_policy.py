"""The transfer model, its calibration, the pull-aware policy and the
simulator's pulls. Pure logic and the simulator: no Ray, no Redis, no model."""

from __future__ import annotations

import json

import pytest

from router.costs.transfer_model import TransferModel, fleet_rate
from router.policy import AffinityPullPolicy, ReplicaView, RouteRequest, make_policy
from router.protocol.hashing import block_hashes
from router.protocol.messages import KvSource
from router.sim.cli import default_trace, main
from router.sim.engine import SimConfig, run_policy
from router.sim.oracle import pooled_lru_hits
from router.sim.workload import SimRequest, load_mooncake
from tests.helpers.index import loads_from_redis

BS = 512
TRACE = default_trace()


# ---- transfer model -------------------------------------------------------------------------


def test_pull_time_is_fixed_cost_plus_bytes_over_rate():
    t = TransferModel(kv_bytes_per_token=320_000, bytes_per_s=25e9, fixed_s=0.002, prefill_tokens_per_s=7000)
    assert t.pull_s(0) == 0.0
    assert t.pull_s(1000) == pytest.approx(0.002 + 1000 * 320_000 / 25e9)
    assert t.prefill_s(7000) == pytest.approx(1.0)
    assert t.pull_tokens_equiv(1000) == pytest.approx(t.pull_s(1000) * 7000)
    # below the break-even link speed no pull beats recomputing, above it long ones do
    assert t.breakeven_bytes_per_s() == pytest.approx(320_000 * 7000)
    slow = t.calibrated(bytes_per_s=2e9)
    assert not slow.pays(100_000)
    assert t.pays(512) and not t.pays(1)  # one token cannot pay for the fixed cost


def test_transfer_model_refuses_nonsense_and_calibration_keeps_unmeasured_figures():
    with pytest.raises(ValueError, match="bytes_per_s"):
        TransferModel(bytes_per_s=0)
    with pytest.raises(ValueError, match="fixed_s"):
        TransferModel(fixed_s=-1)
    t = TransferModel()
    c = t.calibrated(bytes_per_s=5e9, prefill_tokens_per_s=None, kv_bytes_per_token=0)
    assert c.bytes_per_s == 5e9
    assert c.fixed_s == 0.0  # a measured rate is end to end: it already carries the fixed cost
    assert t.calibrated(prefill_tokens_per_s=1000).fixed_s == t.fixed_s
    assert c.prefill_tokens_per_s == t.prefill_tokens_per_s and c.kv_bytes_per_token == t.kv_bytes_per_token
    assert t.calibrated() is t


def test_fleet_rate_is_the_median_of_measured_reports():
    assert fleet_rate([]) is None
    assert fleet_rate([0, None]) is None
    assert fleet_rate([10, 0, 30, 1000]) == 30


# ---- policy ---------------------------------------------------------------------------------


def route(blocks: int, session: str | None = None) -> RouteRequest:
    return RouteRequest(list(range(1, blocks + 1)), blocks * BS + 1, BS, session)


def busy_holder_and_idle_replica() -> list[ReplicaView]:
    """r0 holds the whole 16-block prefix but has a long queue (more than copy_weight x the
    prefix, less than miss_weight x it); r1 is idle and holds nothing."""
    return [
        ReplicaView("r0", matched_blocks=16, running=8, waiting=4, pending_prefill_tokens=28_000),
        ReplicaView("r1"),
    ]


def test_busy_holder_idle_replica_pulls_from_the_holder():
    p = make_policy("affinity-pull", seed=0)
    req = route(16)
    d = p.choose(req, busy_holder_and_idle_replica())
    assert (d.replica_id, d.reason, d.pull) == ("r1", "pull", KvSource("r0", 16))
    # affinity, which cannot pull, stays with the holder (a recompute elsewhere is dearer)
    assert make_policy("affinity", seed=0).choose(route(16), busy_holder_and_idle_replica()).replica_id == "r0"


def test_an_idle_holder_is_a_local_hit_not_a_pull():
    p = make_policy("affinity-pull", seed=0)
    d = p.choose(route(16), [ReplicaView("r0", matched_blocks=16), ReplicaView("r1")])
    assert (d.replica_id, d.pull) == ("r0", None)


def test_slow_link_means_recompute_and_calibration_changes_the_price():
    p = AffinityPullPolicy(seed=0)
    p.calibrate(bytes_per_s=1e9)  # below break-even (320 KB x ~7k tokens/s = 2.24 GB/s)
    d = p.choose(route(16), busy_holder_and_idle_replica())
    assert d.pull is None
    p.calibrate(bytes_per_s=25e9)
    d = p.choose(route(16), busy_holder_and_idle_replica())
    assert (d.replica_id, d.pull.replica_id) == ("r1", "r0")


def test_pull_depth_leaves_one_token_to_compute_and_ranks_fallbacks_by_pull_cost():
    p = AffinityPullPolicy(seed=0)
    req = RouteRequest(list(range(1, 9)), 8 * BS, BS)  # exactly 8 full blocks: only 7 can be pulled
    views = [ReplicaView("r0", matched_blocks=8, running=20, pending_prefill_tokens=50_000),
             ReplicaView("r1", running=1), ReplicaView("r2", running=2)]
    d = p.choose(req, views)
    assert d.pull == KvSource("r0", 7)
    ranked = [v.replica_id for v in p.rank(req, views)]
    assert ranked == ["r1", "r2", "r0"]


def test_commit_charges_only_the_prefill_left_after_a_pull():
    p = AffinityPullPolicy(seed=0, balance_memory=1e9)
    req = route(16)
    d = p.choose(req, busy_holder_and_idle_replica())
    assert d.replica_id == "r1"
    charged = p._recent["r1"] / p._growth
    assert charged == pytest.approx(1)  # 16 blocks pulled, the trailing token computed


def test_pull_weights_price_recompute_as_affinity_does():
    """miss_weight 4 (affinity's) and copy_weight 3: where no pull pays (a link slower than the
    break-even), affinity-pull prices and decides exactly as affinity, on any views."""
    import random

    p = AffinityPullPolicy(seed=0)
    assert (p.miss_weight, p.copy_weight) == (4.0, 3.0)
    p.calibrate(bytes_per_s=1e9)  # below break-even: never offered
    aff = make_policy("affinity", seed=0)
    rng = random.Random(5)
    for i in range(300):
        blocks = rng.randint(1, 40)
        req = RouteRequest(list(range(1, blocks + 1)), blocks * BS + rng.randint(0, BS - 1), BS)
        views = [ReplicaView(f"r{j}", matched_blocks=rng.randint(0, blocks), running=rng.randint(0, 6),
                             waiting=rng.randint(0, 4), pending_prefill_tokens=rng.randint(0, 40_000))
                 for j in range(4)]
        assert p.rank(req, views) == aff.rank(req, views)
        assert p.choose(req, views).replica_id == aff.choose(req, views).replica_id, i


def test_a_holder_past_the_publish_depth_is_not_left_for_a_capped_pull():
    """A 120-block prompt hashed to 64: r0 matches all 64 (so most likely the whole prompt)
    with a queue, r1 is idle. A pull is capped at the 64 blocks the router saw, so moving the
    request means pulling 64 and recomputing 56: the holder is cheaper and keeps it (before, it
    was priced as saving 64 blocks only and the request went to r1 to pull and recompute)."""
    req = RouteRequest(list(range(1, 65)), 120 * BS + 1, BS)
    views = [ReplicaView("r0", matched_blocks=64, running=4, waiting=2, pending_prefill_tokens=40_000),
             ReplicaView("r1")]
    d = make_policy("affinity-pull", seed=0).choose(req, views)
    assert (d.replica_id, d.pull) == ("r0", None)
    assert make_policy("affinity", seed=0).choose(req, views).replica_id == "r0"


# ---- simulator ------------------------------------------------------------------------------


def chat(prompt_blocks: list[list[int]], gap: float) -> list[SimRequest]:
    return [SimRequest(i * gap, p, len(p) * BS, 4) for i, p in enumerate(prompt_blocks)]


def test_sim_pull_counts_blocks_and_inserts_them_as_if_computed():
    """A warm-up request caches an 8-block prefix on one replica; then a burst of requests
    sharing it arrives, more than the holder can take without a queue: some go to the other
    replica, which pulls the prefix instead of computing it, and holds it from then on."""
    a = list(range(1, 9))
    reqs = [SimRequest(0.0, a + [100], 9 * BS, 4)]
    reqs += [SimRequest(1.0 + i * 0.01, a + [200 + i], 9 * BS, 4) for i in range(20)]
    config = SimConfig(replicas=2, capacity_blocks=256, block_size=BS)
    r = run_policy(reqs, make_policy("affinity-pull", seed=0), config)
    assert r.reasons.get("pull", 0) >= 1
    assert r.pulled_blocks >= 8
    assert r.pull_bytes == r.pulled_blocks * BS * config.transfer.kv_bytes_per_token
    assert r.hit_rate == pytest.approx((r.hit_blocks + r.pulled_blocks) / r.prompt_blocks)
    assert r.pull_p50_s == pytest.approx(config.transfer.pull_s(8 * BS))
    # every request after the warm-up got the prefix without computing it: 8 of its 9 blocks
    assert r.hit_blocks + r.pulled_blocks == 20 * 8
    # affinity on the same stream never pulls, and computes the prefix again or queues
    aff = run_policy(reqs, make_policy("affinity", seed=0), config)
    assert aff.pulled_blocks == 0
    assert r.ttft_p99_s < aff.ttft_p99_s


def test_sim_pull_reads_the_source_at_arrival():
    """The pull reads the holder's pool when the request reaches the puller (a live replica
    pulls before the request queues for its engine): the holder evicting the prefix while the
    request waits does not shorten the pull. Evicted before the request arrives, nothing is
    pulled and the request recomputes, and still completes."""
    from router.costs.service import ServiceModel
    from router.index.memory_index import InMemoryIndex
    from router.sim.replica import Job, SimReplica

    def fleet():
        index = InMemoryIndex()
        holder = SimReplica("r0", 4, BS, ServiceModel(), index)
        puller = SimReplica("r1", 8, BS, ServiceModel(), index)
        first = SimRequest(0.0, [1, 2, 3], 3 * BS, 1)
        holder.enqueue(Job(first, 0.0, 3 * BS, 0))
        holder.try_start(0.0)
        job, _ = holder.prefill_done(1.0)
        holder.finish(job)
        assert index.match([1, 2, 3], ["r0"]) == {"r0": 3}
        return index, holder, puller

    def evict(holder):
        other = SimRequest(1.0, [7, 8, 9], 3 * BS, 1)  # evicts 1, 2, 3 from the holder's 4 blocks
        holder.enqueue(Job(other, 1.0, 3 * BS, 0))
        holder.try_start(1.0)

    late = SimRequest(1.0, [1, 2, 3, 4], 4 * BS, 1)
    # evicted after the arrival: the pull already has the blocks
    index, holder, puller = fleet()
    pull = Job(late, 1.0, BS, 0, pull_from=holder, pull_depth=holder.export_run(late.hashes, 3))
    puller.enqueue(pull)
    evict(holder)
    assert index.match([1, 2, 3], ["r0"])["r0"] < 3
    assert puller.try_start(1.5) is not None
    assert pull.pulled_blocks == 3 and pull.uncached == BS
    # evicted before it: nothing to read, recompute
    index, holder, puller = fleet()
    evict(holder)
    assert holder.export_run(late.hashes, 3) == 0
    pull = Job(late, 1.0, 4 * BS, 0)
    puller.enqueue(pull)
    assert puller.try_start(1.5) is not None
    assert pull.pulled_blocks == 0 and pull.uncached == 4 * BS
    pull_done, _ = puller.prefill_done(3.0)
    assert index.match([1, 2, 3, 4], ["r1"]) == {"r1": 4}  # recomputed blocks registered
    puller.finish(pull_done)


@pytest.mark.slow
@pytest.mark.skipif(not TRACE.exists(), reason="shared Mooncake trace not present")
def test_mooncake_pulls_raise_hit_rate_towards_the_pooled_oracle():
    """First 4000 requests (the trace's warm-up, less reuse than the whole), 8 replicas of
    1000 blocks: pulled blocks count as hits, so affinity-pull gets closer to the pooled oracle
    than affinity (96.7% vs 92.7% when written) and its median TTFT is lower. Matched to any
    depth: at the default publish_depth (64 of the trace's 512-token blocks) the long prompts'
    matches are capped and pull pricing undervalues them (docs/simulator.md)."""
    from router.sim.router_config import SimRouterConfig

    requests = load_mooncake(TRACE, limit=4000)
    config = SimConfig(replicas=8, capacity_blocks=1000, router=SimRouterConfig(publish_depth=100_000))
    aff = run_policy(requests, make_policy("affinity", seed=0), config)
    pull = run_policy(requests, make_policy("affinity-pull", seed=0), config)
    pooled = pooled_lru_hits(requests, 8 * 1000) / pull.prompt_blocks
    assert pull.pulled_blocks > 0 and aff.pulled_blocks == 0
    assert pull.hit_rate > aff.hit_rate
    assert pull.hit_rate >= 0.95 * pooled
    assert pull.ttft_p50_s < aff.ttft_p50_s


def test_sim_cli_takes_transfer_overrides(tmp_path, capsys):
    out = tmp_path / "sim.json"
    argv = ["--workload", "rag", "--limit", "400", "--replicas", "4", "--capacity", "300",
            "--policies", "affinity-pull", "--transfer", "bytes_per_s=3e9", "--json", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["transfer"]["bytes_per_s"] == 3e9
    row = data["settings"][0]["rows"][0]
    assert row["policy"] == "affinity-pull" and "pull_bytes_per_request" in row
    assert "pulled" in capsys.readouterr().out
    assert main(["--workload", "rag", "--transfer", "bytes_per_s=0"]) == 2


# ---- sim engine (the live fleet's replicas) -------------------------------------------------


def test_sim_engine_models_a_pull_as_cached_blocks_plus_transfer_time():
    """The router's hint on a sim replica: the hinted blocks enter its BlockManager as if
    computed (announced to listeners) when the modelled transfer ends, the request reports them
    as cached tokens, and its steps cost only the prefill left: as on a real replica, the pull
    happens before the engine sees the request, so it delays that request alone, never the
    running batch's steps."""
    from replica.backends.sim_engine import SimEngine
    from replica.engine_config import SimEngineConfig
    from router.protocol.sampling import SamplingParams

    bs = 16
    prompt = list(range(1000, 1000 + 10 * bs + 3))  # 10 full blocks + 3 tokens

    class Events:
        """KV event listener: what the replica would publish to the index."""

        def __init__(self) -> None:
            self.hashes: list[int] = []

        def stored(self, hashes: list[int], positions: list[int]) -> None:
            self.hashes.extend(hashes)

        def removed(self, hashes: list[int]) -> None:
            pass

        def cleared(self) -> None:
            pass

    def run(pull_blocks: int) -> tuple[SimEngine, object, float, Events]:
        e = SimEngine(SimEngineConfig(block_size=bs, num_blocks=64, time_scale=1000.0))
        events = Events()
        e.add_listener(events)
        e.add_request(prompt, SamplingParams(max_tokens=2), request_id="r", kv_pull_blocks=pull_blocks)
        out = None
        while e.has_unfinished:
            for o in e.step():
                out = o
        return e, out, e.lag.modelled_s * e.config.time_scale, events

    pulled, out, modelled_pull, events = run(8)
    assert pulled.pulls == 1 and pulled.pulled_blocks == 8
    assert out.num_cached_tokens == 8 * bs
    expected = block_hashes(prompt, bs, pulled.hash_seed())
    assert events.hashes[:8] == expected[:8]  # announced at the pull, before any compute
    assert sorted(events.hashes) == sorted(expected)  # then the computed ones
    cold, cold_out, modelled_cold, _ = run(0)
    assert cold_out.num_cached_tokens == 0 and cold.pulls == 0
    # 8 blocks pulled instead of computed: the steps skip their prefill, the transfer is not in any step
    service = cold.service
    assert modelled_cold - modelled_pull == pytest.approx(8 * bs * service.prefill_s_per_token, rel=1e-6)
    # while its transfer runs the request is queued work the router can see, not yet scheduled;
    # another request keeps stepping meanwhile. The hint never pulls the prompt's last token.
    e = SimEngine(SimEngineConfig(block_size=bs, num_blocks=64, time_scale=1e-3))  # a pull of seconds
    e.add_request(list(range(3000, 3000 + 2 * bs)), SamplingParams(max_tokens=1), request_id="other")
    e.add_request(list(range(2000, 2000 + 4 * bs)), SamplingParams(max_tokens=1), kv_pull_blocks=99, request_id="p")
    assert e.stats().waiting == 2 and e.stats().pending_prefill_tokens == 6 * bs
    assert e.pulls == 1 and e.pulled_blocks == 0 and e.pull_times == [e.transfer.pull_s(3 * bs)]
    e.config.time_scale = 1e3  # the other request's prefill, then the pull, at full speed
    done = [o.request_id for o in e.step() if o.finished]
    assert done == ["other"] and e.pulled_blocks == 0  # it ran while "p" was still pulling
    assert e.abort("p") and not e.has_unfinished  # a request aborted mid-pull never reaches the scheduler
    assert e.pull_rates() == {"kv_pull_bytes_per_s": 25_000_000_000, "prefill_tokens_per_s": 7142}


def test_sim_cli_policy_options_go_to_the_policies_that_take_them():
    from router.sim.cli import check_options, options_for

    opts = {"copy_weight": 0.5, "miss_weight": 4.0}
    assert options_for("affinity-pull", opts) == opts
    assert options_for("affinity", opts) == {"miss_weight": 4.0}
    assert options_for("least-loaded", opts) == {}
    check_options(opts)
    with pytest.raises(ValueError, match="bogus"):
        check_options({"bogus": 1.0})


def test_scaled_transfer_moves_and_computes_a_block_as_at_512_tokens():
    """The fleet harness replays the trace at 16-token blocks: a block must cost the same to
    pull and to compute as a 512-token block at the simulator's scale, on both sides."""
    from dataclasses import replace

    from loadtest.fleet import FleetSpec, app_config, settings_for, workload
    from loadtest.fleet_report import sim_result
    from router.sim.trace import scale_transfer

    t = TransferModel()
    s16 = scale_transfer(t, 16)
    assert s16.pull_s(16) == pytest.approx(t.pull_s(512))
    assert s16.prefill_s(16) == pytest.approx(t.prefill_s(512))
    assert s16.breakeven_bytes_per_s() == pytest.approx(t.breakeven_bytes_per_s())
    if not TRACE.exists():
        return
    spec = FleetSpec(trace=str(TRACE), requests=1000, capacity="0.02")
    s, kept, _ = settings_for(spec, workload(spec), 16)
    # the live sim replicas get the same scaled pull model the simulator uses
    cfg = app_config(spec, s, "affinity-pull", "redis://127.0.0.1:1", "x")
    sim = replace(cfg, engine="sim").engine_settings("m").config
    assert sim.kv_bytes_per_token == pytest.approx(t.kv_bytes_per_token * 32)
    r = sim_result("affinity-pull", kept, s, spec.service)
    assert r.reasons.get("pull", 0) > 0  # the fleet's simulator side pulls, and counts them as hits


def test_router_prices_pulls_with_the_fleets_measured_rates(redis_server):
    """Heartbeats in a real Redis -> the router's load table -> the fleet's median rates -> the
    policy's transfer model. A replica that has not measured (0) does not count."""
    import uuid

    import redis as redis_lib

    from router.protocol.redis_schema import RedisKeys

    prefix = f"pull-{uuid.uuid4().hex[:6]}"
    keys = RedisKeys(prefix)
    r = redis_lib.Redis.from_url(redis_server.url)
    beats = {"ra": (2e9, 900, 46_080), "rb": (4e9, 1100, 46_080), "rc": (0, 0, 46_080), "rd": (8e9, 1000, 46_080)}
    for rid, (bps, tps, kv) in beats.items():
        r.hset(keys.heartbeat(rid), mapping={"running": 0, "kv_pull_bytes_per_s": int(bps),
                                             "prefill_tokens_per_s": tps, "kv_bytes_per_token": kv})

    loads = loads_from_redis(redis_server.url, prefix, list(beats))
    assert loads.measured("kv_pull_bytes_per_s") == 4e9  # median of 2, 4, 8 (rc measured nothing)
    assert loads.measured("prefill_tokens_per_s") == 1000
    assert loads.measured("no_such_field") is None
    p = AffinityPullPolicy(seed=0)
    p.calibrate(bytes_per_s=loads.measured("kv_pull_bytes_per_s"), prefill_tokens_per_s=loads.measured("prefill_tokens_per_s"),
                kv_bytes_per_token=loads.measured("kv_bytes_per_token"))
    assert (p.transfer.bytes_per_s, p.transfer.prefill_tokens_per_s, p.transfer.kv_bytes_per_token) == (4e9, 1000, 46_080)
    r.close()


def test_demote_makes_a_given_away_copy_the_next_to_evict():
    """After another replica pulled a copy, the holder's copy goes first (its tail before its
    head, as `free` orders a prompt); blocks in use are not moved."""
    from replica.kvcache.block_manager import BlockManager, BlockTable

    bm = BlockManager(num_blocks=6, block_size=BS)
    old = BlockTable(hashes=[1, 2])
    given = BlockTable(hashes=[11, 12, 13])
    for t in (old, given):
        bm.allocate(t, len(t.hashes) * BS)
        bm.commit(t, [], len(t.hashes) * BS, seed=0)
    bm.free(old)
    bm.free(given)  # LRU, oldest first: 2, 1, 13, 12, 11 (and one free block)
    busy = BlockTable(hashes=[1])
    bm.allocate(busy, BS + 1)  # takes block 1 (in use) plus the free block
    assert bm.demote([11, 12, 13, 1, 99]) == 3  # 1 is in use, 99 not held
    nxt = BlockTable(hashes=[21, 22, 23])
    bm.allocate(nxt, 3 * BS)  # needs 3 blocks: evicts 13, 12, 11 and keeps 2
    assert set(bm.hash_to_block) == {1, 2}


def test_sim_holder_modes_change_only_the_holders_lru():
    a = list(range(1, 9))
    reqs = [SimRequest(0.0, a + [100], 9 * BS, 4)]
    reqs += [SimRequest(1.0 + i * 0.01, a + [200 + i], 9 * BS, 4) for i in range(20)]
    results = {m: run_policy(reqs, make_policy("affinity-pull", seed=0),
                             SimConfig(replicas=2, capacity_blocks=256, block_size=BS, pull_holder=m))
               for m in ("keep", "touch", "demote")}
    assert all(r.pulled_blocks >= 8 for r in results.values())
    with pytest.raises(ValueError, match="pull_holder"):
        run_policy(reqs, make_policy("affinity-pull", seed=0), SimConfig(replicas=2, capacity_blocks=256, pull_holder="x"))
