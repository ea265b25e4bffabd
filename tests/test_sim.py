"""The routing simulator: oracles by hand, the BlockManager wiring, and the real trace."""

from __future__ import annotations

import json

import pytest

from replica.kvcache.block_manager import BlockManager, BlockTable
from router.index.memory_index import InMemoryIndex
from router.policy import make_policy
from router.sim.cli import capacity_blocks, default_trace, main
from router.sim.engine import SimConfig, run_policy
from router.sim.metrics import percentile, window_imbalance
from router.sim.oracle import pooled_lru_hits, unbounded_hits
from router.sim.replica import IndexFeed
from router.sim.workload import ChatWorkload, RagWorkload, SimRequest, load_mooncake

TRACE = default_trace()


def reqs(*prompts: list[int], gap: float = 100.0) -> list[SimRequest]:
    return [SimRequest(i * gap, list(p), len(p) * 16, 4) for i, p in enumerate(prompts)]


HAND = reqs([1, 2, 3], [1, 2, 4], [5], [1, 2, 3])  # 10 prompt blocks


def test_unbounded_oracle_by_hand():
    # R1 cold 0; R2 hits 1,2 (4 is new) = 2; R3 cold 0; R4 hits 1,2,3 = 3  -> 5 of 10
    assert unbounded_hits(HAND) == 5


def test_pooled_lru_oracle_by_hand():
    # capacity 3, LRU order oldest first, each prompt touched tail first:
    # R1 miss x3, cache [3,2,1]; R2 hits 1,2 (=2), touch 4,2,1 -> [3,4,2,1] evict 3 -> [4,2,1]
    # R3 miss, [4,2,1,5] evict 4 -> [2,1,5]; R4 hits 1,2, misses 3 (=2) -> 4 in all
    assert pooled_lru_hits(HAND, 3) == 4
    # capacity 1 keeps only each prompt's first block: R2 hits 1 (=1), R3 leaves [5], R4 misses
    assert pooled_lru_hits(HAND, 1) == 1
    # big enough, it is the unbounded cache
    assert pooled_lru_hits(HAND, 100) == unbounded_hits(HAND)


def test_leading_match_stops_at_first_miss():
    # block 9 was seen, but block 8 before it was not: chained keys cannot hit past a miss
    assert unbounded_hits(reqs([7, 9], [8, 9])) == 0


def test_percentile_and_window_imbalance():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    # windows: balanced (1.0), all on one of two replicas (2.0), idle (skipped)
    assert window_imbalance([[1, 1], [2, 0], [0, 0]], 95) == pytest.approx(1.95)


def test_index_feed_follows_the_block_manager():
    """The index sees exactly what the BlockManager caches, evictions included."""
    index = InMemoryIndex()
    bm = BlockManager(num_blocks=4, block_size=16)
    bm.listeners.append(IndexFeed("r0", index))
    a = BlockTable(hashes=[11, 12, 13])
    assert bm.allocate(a, 3 * 16 + 1) == 0
    assert index.match([11, 12, 13], ["r0"]) == {"r0": 0}  # nothing cached before commit
    bm.commit(a, [], 3 * 16, seed=0)
    assert index.match([11, 12, 13], ["r0"]) == {"r0": 3}
    bm.free(a)
    b = BlockTable(hashes=[21, 22])  # needs 3 blocks: evicts the LRU tail (13, then 12)
    bm.allocate(b, 2 * 16 + 1)
    assert index.match([11, 12, 13], ["r0"]) == {"r0": 1}


def test_single_replica_with_ample_memory_hits_the_unbounded_oracle():
    requests = reqs([1, 2, 3], [1, 2, 4], [5], [1, 2, 3], [1, 2, 4, 6])
    config = SimConfig(replicas=1, capacity_blocks=100, block_size=16)
    result = run_policy(requests, make_policy("affinity", seed=0), config)
    # hits: 0 + 2 (1,2) + 0 + 3 (1,2,3) + 3 (1,2,4; 6 is new) = 8
    assert result.hit_blocks == unbounded_hits(requests) == 8
    assert result.prompt_blocks == 14
    assert result.rejected == 0


def test_prompts_larger_than_a_replica_are_rejected():
    config = SimConfig(replicas=2, capacity_blocks=3, block_size=16)
    result = run_policy(reqs([1, 2, 3, 4, 5], [1]), make_policy("random", seed=0), config)
    assert result.rejected == 1
    assert result.requests == 2


def test_affinity_keeps_conversations_together():
    """Generated multi-turn chats: routing by affinity must beat cache-blind routing."""
    requests = ChatWorkload(sessions=300, duration_s=300.0).generate(seed=1)
    config = SimConfig(replicas=4, capacity_blocks=400, block_size=512)
    hit = {
        name: run_policy(requests, make_policy(name, seed=0), config).hit_rate
        for name in ("affinity", "least-loaded")
    }
    assert hit["affinity"] > hit["least-loaded"] + 0.1


def test_generated_workloads_share_prefixes_as_described():
    chat = ChatWorkload(sessions=50, duration_s=600.0, think_s_mean=5.0).generate(seed=3)
    by_session: dict[str, list[SimRequest]] = {}
    for r in chat:
        by_session.setdefault(r.session_id, []).append(r)
    multi = [turns for turns in by_session.values() if len(turns) > 1]
    assert multi
    for turns in multi:
        for prev, nxt in zip(turns, turns[1:], strict=False):
            full = prev.input_tokens // 512
            assert nxt.hashes[:full] == prev.hashes[:full]  # every full block carries over
    rag = RagWorkload(requests=200).generate(seed=3)
    assert all(r.session_id is None for r in rag)
    assert unbounded_hits(rag) > 0
    assert rag == RagWorkload(requests=200).generate(seed=3)  # seeded


def test_capacity_specs():
    assert capacity_blocks("tight", 182_790) == 1828
    assert capacity_blocks("ample", 182_790) == 9140
    assert capacity_blocks("2%", 1000) == 20
    assert capacity_blocks("0.5", 1000) == 500
    assert capacity_blocks("1500", 1000) == 1500


def test_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "sim.json"
    argv = ["--workload", "rag", "--limit", "400", "--replicas", "4", "--capacity", "300",
            "--policies", "affinity", "random", "--json", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    (setting,) = data["settings"]
    assert setting["replicas"] == 4 and setting["capacity_blocks"] == 300
    assert [r["policy"] for r in setting["rows"]] == ["affinity", "random"]
    assert 0 <= setting["rows"][0]["hit_rate"] <= setting["oracle_unbounded"]
    assert "affinity" in capsys.readouterr().out
    assert main(["--workload", "rag", "--service", "no_such_field=1"]) == 2


@pytest.mark.slow
@pytest.mark.skipif(not TRACE.exists(), reason="shared Mooncake trace not present")
def test_mooncake_affinity_beats_the_baselines_at_8_replicas():
    """First 6000 requests of the real trace, 8 replicas, tight capacity (1% of the distinct
    blocks of the full trace each), no session ids (the simulator's default for this trace, so
    `session` hashes the shared first block; with pseudo-sessions it is a near-perfect
    partitioner here, see docs/simulator.md)."""
    requests = load_mooncake(TRACE, limit=6000)
    config = SimConfig(replicas=8, capacity_blocks=1828)
    results = {
        name: run_policy(requests, make_policy(name, seed=0), config)
        for name in ("affinity", "session", "pow2", "least-loaded", "random")
    }
    hit = {name: r.hit_rate for name, r in results.items()}
    for other in ("session", "pow2", "least-loaded", "random"):
        assert hit["affinity"] > hit[other], hit
    pooled = pooled_lru_hits(requests, 8 * 1828) / results["affinity"].prompt_blocks
    assert hit["affinity"] >= 0.85 * pooled
    assert results["affinity"].ttft_p99_s <= results["least-loaded"].ttft_p99_s
