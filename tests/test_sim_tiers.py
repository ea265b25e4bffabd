"""K/V tiers below the pool in the simulator and the sim engine: hits counted per
tier, their copy charged at the modelled rate, the oracle at the combined capacity."""

from __future__ import annotations

import dataclasses
import json

import pytest

from loadtest.fleet import FleetSpec, app_config, settings_for
from loadtest.fleet_report import oracles
from replica.backends.sim_engine import SimEngine
from replica.engine_config import SimEngineConfig
from router.costs.service import ServiceModel
from router.costs.transfer_model import NVME_DISK_BYTES_S, PCIE_HOST_BYTES_S, TransferModel
from router.index.memory_index import InMemoryIndex
from router.policy import make_policy
from router.protocol.media import DISK, HOST
from router.protocol.sampling import SamplingParams
from router.sim.cli import main
from router.sim.engine import SimConfig, run_policy
from router.sim.replica import Job, SimReplica
from router.sim.tiers import TierConfig
from router.sim.trace import prompt_tokens, scale_rows
from router.sim.workload import ChatWorkload, SimRequest

BS = 16
FAST = 1000.0


def run_one(rep: SimReplica, req: SimRequest) -> tuple[Job, float]:
    """One request alone on the replica: (its job, when its prefill ended)."""
    job = Job(req, 0.0, 0, 0)
    rep.enqueue(job)
    end = rep.try_start(0.0)
    done, _ = rep.prefill_done(end)
    rep.finish(done)
    return done, end


def test_tier_flag_sizes():
    assert TierConfig.from_flags("4x", "0", 457) == TierConfig(1828, 0)
    assert TierConfig.from_flags("100", "2.5x", 10).blocks == 125
    with pytest.raises(ValueError):
        TierConfig(-1)


def test_a_host_tier_hit_is_counted_charged_and_published():
    """A prompt evicted from a 4-block pool comes back from the host tier: a hit, copied at the
    host rate before the prefill; the index and the heartbeat see the tier."""
    index = InMemoryIndex()
    service = ServiceModel()
    rep = SimReplica("r0", 4, BS, service, index, tiers=TierConfig(host_blocks=8))
    a = SimRequest(0.0, [1, 2, 3], 3 * BS + 1, 1)
    run_one(rep, a)
    run_one(rep, SimRequest(0.0, [4, 5, 6], 3 * BS + 1, 1))  # evicts a's blocks into the host tier
    held = index.match_media(a.hashes, ["r0"])["r0"]
    assert held.matched_blocks == 3 and held.tier_blocks.get(HOST, 0) >= 1
    hb = rep.heartbeat(0.0)
    assert hb["host_capacity_blocks"] == 8 and hb["host_blocks"] >= 1
    assert hb["kv_host_bytes_per_s"] == int(PCIE_HOST_BYTES_S) and hb["disk_capacity_blocks"] == 0
    moved = held.tier_blocks[HOST]
    job, end = run_one(rep, a)
    assert job.hit_blocks == 3 and job.promoted == {HOST: moved}
    block_bytes = TransferModel().kv_bytes_per_token * BS
    assert job.tier_s == pytest.approx(moved * block_bytes / PCIE_HOST_BYTES_S)
    assert end == pytest.approx(job.tier_s + service.prefill_s(1, 0))
    assert rep.bm.stats.tier_hit_tokens == {HOST: moved * BS}


def test_tiers_raise_the_hit_rate_and_the_columns_add_up():
    requests = ChatWorkload(sessions=120, duration_s=120.0).generate(seed=3)
    base = SimConfig(replicas=4, capacity_blocks=20, block_size=512)
    policy = "affinity"
    without = run_policy(requests, make_policy(policy, seed=0), base)
    tiers = TierConfig(host_blocks=20, disk_blocks=40)
    with_tiers = run_policy(requests, make_policy(policy, seed=0), SimConfig(**{**vars(base), "tiers": tiers}))
    assert with_tiers.hit_rate > without.hit_rate + 0.1  # 62.8% against 46.8%
    assert with_tiers.host_hit_blocks > 0 and with_tiers.disk_hit_blocks > 0
    assert without.host_hit_blocks == without.disk_hit_blocks == 0
    for r in (without, with_tiers):
        assert sum(r.tier_shares.values()) == pytest.approx(r.hit_rate)
    assert with_tiers.tier_bytes == pytest.approx(
        (with_tiers.host_hit_blocks + with_tiers.disk_hit_blocks) * 512 * TransferModel().kv_bytes_per_token)


def test_cli_reports_tiers_and_the_oracle_at_the_combined_capacity(tmp_path, capsys):
    out = tmp_path / "sim.json"
    argv = ["--workload", "chat", "--limit", "300", "--replicas", "2", "--capacity", "50", "--host-blocks", "2x",
            "--disk-blocks", "40", "--policies", "affinity", "--json", str(out)]
    assert main(argv) == 0
    (setting,) = json.loads(out.read_text())["settings"]
    assert setting["tiers"]["host_blocks"] == 100 and setting["tiers"]["disk_blocks"] == 40
    assert setting["oracle_pooled_blocks"] == 2 * (50 + 100 + 40)
    (row,) = setting["rows"]
    parts = ("device", "host", "disk", "pulled")
    assert sum(row[f"{p}_hit_rate"] for p in parts) == pytest.approx(row["hit_rate"])
    assert "host" in capsys.readouterr().out
    assert main(["--workload", "chat", "--host-blocks", "lots"]) == 2


def test_sim_engine_host_hit_matches_the_simulator():
    """Anti-drift with tiers: the same rows through the sim engine and the simulator's replica,
    pools of 6 blocks over host and disk tiers, hit the same blocks in the same tiers, and the
    engine's modelled time to first token (copy back included) equals the simulator's."""
    rows = [{"timestamp": i, "hash_ids": ids, "output_length": 1} for i, ids in enumerate(
        ([1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 2, 3, 10], [11, 12, 13, 14], [4, 5, 6, 15], [1, 2, 3, 10]))]
    reqs = scale_rows(rows, BS, max_output=1)
    e = SimEngine(SimEngineConfig(block_size=BS, num_blocks=6, max_num_batched_tokens=4096, time_scale=FAST,
                                  host_blocks=4, disk_blocks=4))
    rep = SimReplica("r0", 6, BS, e.service, InMemoryIndex(), tiers=TierConfig(host_blocks=4, disk_blocks=4))
    copies = 0.0
    for i, req in enumerate(reqs):
        before = e.lag.modelled_s
        [out] = e.generate([prompt_tokens(req, i, BS)], SamplingParams(max_tokens=1))
        ttft_engine = (e.lag.modelled_s - before) * FAST
        done, end = run_one(rep, req)
        assert out.num_cached_tokens == done.hit_blocks * BS, f"row {i}"
        assert ttft_engine == pytest.approx(end), f"row {i}"
        copies += done.tier_s
    tiers = e.stats().tiers
    assert copies > 0 and tiers[HOST].hit_tokens > 0
    assert {m: u.hit_tokens for m, u in tiers.items() if u.hit_tokens} == rep.bm.stats.tier_hit_tokens
    assert tiers[HOST].promotion_bytes_per_s == int(PCIE_HOST_BYTES_S)
    assert tiers[DISK].promotion_bytes_per_s == int(NVME_DISK_BYTES_S)
    assert tiers[HOST].bytes_in == tiers[HOST].demotions * BS * TransferModel().kv_bytes_per_token


def test_fleet_runs_both_sides_with_the_same_tiers():
    """The fleet harness gives the live sim replicas and the simulator the same tiers and rates,
    and its pooled oracle counts them."""
    spec = FleetSpec(trace="unused", capacity="10", host_blocks="4x", disk_blocks="100", host_rate=10e9)
    reqs = scale_rows([{"timestamp": i, "hash_ids": [1, 2, i + 3], "output_length": 1} for i in range(5)], BS, 1)
    s, kept, _ = settings_for(spec, reqs, 2)
    assert s.tiers == TierConfig(40, 100) and len(kept) == 5
    sim = app_config(spec, s, "affinity", "redis://127.0.0.1:1/0", "k").engine_settings("m").config
    assert isinstance(sim, SimEngineConfig)
    assert (sim.host_blocks, sim.disk_blocks) == (40, 100)
    assert sim.kv_host_bytes_per_s == 10e9 and sim.kv_disk_bytes_per_s == NVME_DISK_BYTES_S
    pooled, _ = oracles(kept, s)
    combined = dataclasses.replace(s, capacity_blocks=s.capacity_blocks + s.tiers.blocks, tiers=TierConfig())
    assert pooled > 0 and pooled == oracles(kept, combined)[0]
