"""The simulator's prefill/decode split (issue 53): roles, the hand-over, the step model and
pd_sweep (router/sim/pd_engine.py, pd_replica.py, pd_sweep.py)."""

from __future__ import annotations

import json
import math
import random

import pytest

from router.costs.service import ServiceModel
from router.policy import make_policy
from router.sim import pd_sweep
from router.sim.engine import PD_THRESHOLD_TOKENS, SimConfig, run_policy
from router.sim.pd_engine import run_pd
from router.sim.pd_replica import DECODE, PREFILL, PdJob, PdReplica
from router.sim.pd_workload import GoodputMixWorkload
from router.sim.workload import ChatWorkload, RagWorkload, SimRequest

BS = 16


# ---- colocated: unchanged -------------------------------------------------------------------------
# (hit_blocks, prompt_blocks, ttft_p50_s, ttft_p99_s, utilization, imbalance_p95, reasons) of these
# runs, recorded on the code before roles existed (commit 15da70e)
BEFORE = {
    ("chat", "affinity"): (369, 576, 0.09008714843749743, 0.45375552089843957, 0.05635205278962555,
                           1.3002368445426518, {"load": 13, "prefix": 67, "session": 23}),
    ("chat", "least-loaded"): (264, 576, 0.1384109179687485, 0.5283150501953122, 0.09072512189330628,
                               1.0941957831092417, {"load": 103}),
    ("rag", "affinity"): (2906, 4525, 0.779918215042346, 2.179959142420895, 0.5477459893591254,
                          1.042125245580925, {"load": 31, "prefix": 269}),
    ("rag", "least-loaded"): (1632, 4525, 3.486020145646915, 7.645789058871606, 1.0191320667324704,
                              1.016764989295696, {"load": 300}),
}


@pytest.mark.parametrize("workload,policy", sorted(BEFORE))
def test_colocated_runs_are_unchanged_without_roles(workload, policy):
    wl = ChatWorkload(sessions=80, duration_s=60.0) if workload == "chat" else RagWorkload(
        requests=300, duration_s=60.0, documents=40)
    config = SimConfig(replicas=4, capacity_blocks=300, time_scale=1.0)
    assert (config.prefill_replicas, config.decode_replicas, config.step_model) == (0, 0, False)
    d = run_policy(wl.generate(seed=3), make_policy(policy, seed=3), config).to_dict()
    got = (d["hit_blocks"], d["prompt_blocks"], d["ttft_p50_s"], d["ttft_p99_s"], d["utilization"],
           d["imbalance_p95"], d["reasons"])
    assert got == BEFORE[(workload, policy)]
    assert "pd" not in d  # a colocated run's JSON rows as before


# ---- the hand-over --------------------------------------------------------------------------------
def split(p: int, d: int, **kw) -> SimConfig:
    return SimConfig(replicas=p + d, capacity_blocks=2000, block_size=BS, prefill_replicas=p, decode_replicas=d, **kw)


def run(requests: list[SimRequest], config: SimConfig) -> tuple[list[PdJob], list[PdReplica]]:
    jobs: list[PdJob] = []
    reps: list[PdReplica] = []
    run_pd(requests, make_policy("affinity", seed=0), make_policy("affinity", seed=0), config, jobs, reps)
    jobs.sort(key=lambda j: j.arrival)
    return jobs, reps


def test_a_split_needs_the_replicas_to_add_up():
    with pytest.raises(ValueError, match="prefill_replicas \\+ decode_replicas"):
        run_policy([SimRequest(0.0, [1], BS, 2)], make_policy("affinity"),
                   SimConfig(replicas=4, capacity_blocks=100, prefill_replicas=1, decode_replicas=2))


def test_short_prompts_stay_on_the_decode_replica_long_ones_are_handed_over():
    rng = random.Random(1)
    reqs = []
    for i in range(60):  # uncached lengths on both sides of the threshold, all fresh blocks
        tokens = rng.choice([BS, 10 * BS, PD_THRESHOLD_TOKENS, PD_THRESHOLD_TOKENS + 1, 100 * BS])
        blocks = -(-tokens // BS)
        reqs.append(SimRequest(i * 0.05, list(range(1000 * i, 1000 * i + blocks)), tokens, 8))
    jobs, _ = run(reqs, split(1, 3))
    assert len(jobs) == 60
    for j in jobs:
        assert j.handed == (j.req.input_tokens > PD_THRESHOLD_TOKENS), j.req.input_tokens
    assert any(j.handed for j in jobs) and not all(j.handed for j in jobs)


def test_the_decode_replica_gains_the_blocks_and_ttft_includes_the_transfer():
    service = ServiceModel()
    prompt = list(range(1, 101))  # 1,600 tokens, cold everywhere
    first = SimRequest(0.0, prompt, 100 * BS, 5)
    again = SimRequest(30.0, [*prompt, 500], 100 * BS + 8, 5)  # the same prefix, long after
    config = split(1, 1)
    jobs, reps = run([first, again], config)
    a, b = jobs
    prefill, decode = reps
    assert (prefill.role, decode.role) == (PREFILL, DECODE)
    assert a.handed and a.decode_rep is decode
    assert a.transfer_tokens == first.input_tokens
    assert a.transfer_s == config.transfer.pull_s(first.input_tokens) > 0
    # idle fleet: the prefill (whole chunk steps, no decode batch), the transfer, one decode step
    expected = PdReplica("x", 2000, BS, service, prefill.bm.listeners[0].index, role=PREFILL).prefill_time(1600)
    assert a.prefill_end == pytest.approx(expected)
    assert a.ttft == pytest.approx(expected + a.transfer_s + service.step_s(1))
    assert a.first_token - a.arrival == pytest.approx(a.ttft)
    # the decode replica's pool got the prompt's blocks with the hand-over: the same prefix is
    # then short there, so it is not handed over again and hits every one of them
    assert decode.held_run(prompt) == len(prompt)
    assert not b.handed and b.hit_blocks == len(prompt)
    # and the prefill replica let go of them (cached, not pinned)
    assert prefill.bm.num_cached == len(prompt) and prefill.bm.num_free + prefill.bm.num_cached == prefill.bm.num_blocks


def test_a_transfer_moves_only_what_the_decode_replica_lacks():
    prefix = list(range(1, 41))  # 640 tokens, held by the decode replica after the first request
    first = SimRequest(0.0, [*prefix, 900], 41 * BS, 3)
    longer = SimRequest(20.0, [*prefix, *range(2000, 2060)], 100 * BS, 3)  # 60 new blocks: 960 uncached
    jobs, _ = run([first, longer], split(1, 1))
    a, b = jobs
    assert a.handed and b.handed
    assert b.transfer_tokens == longer.input_tokens - len(prefix) * BS


# ---- the physics: decode steps beside long prefills ----------------------------------------------
def prefill_heavy(n: int, seed: int = 0) -> list[SimRequest]:
    """Long cold prompts (2,000-4,000 tokens) among chat-like short ones, all with outputs."""
    rng = random.Random(seed)
    out, t, key = [], 0.0, 1
    for _ in range(n):
        t += rng.expovariate(12.0)
        tokens = rng.randint(2000, 4000) if rng.random() < 0.4 else rng.randint(50, 300)
        blocks = -(-tokens // BS)
        out.append(SimRequest(t, list(range(key, key + blocks)), tokens, rng.randint(40, 120)))
        key += blocks
    return out


def test_tpot_p99_under_a_split_is_below_colocated_on_a_prefill_heavy_workload():
    reqs = prefill_heavy(400)
    colocated = run_policy(reqs, make_policy("affinity", seed=0),
                           SimConfig(replicas=4, capacity_blocks=4000, block_size=BS, step_model=True))
    parted = run_policy(reqs, make_policy("affinity", seed=0),
                        SimConfig(replicas=4, capacity_blocks=4000, block_size=BS, prefill_replicas=2, decode_replicas=2))
    assert colocated.pd is not None and parted.pd is not None
    assert colocated.pd.handed_over == 0 and parted.pd.handed_over > 0
    assert parted.pd.tpot_p99_s < 0.8 * colocated.pd.tpot_p99_s
    # the step model itself: colocated decode steps are stretched past the plain step
    assert colocated.pd.tpot_p99_s > 1.5 * ServiceModel().step_s(64)


def test_without_prefills_beside_it_a_decode_runs_at_the_plain_step():
    """One request alone: its TPOT is step_s(1) exactly (no interference, fluid clock exact)."""
    req = SimRequest(0.0, [1, 2, 3], 3 * BS, 50)
    jobs, _ = run([req], SimConfig(replicas=1, capacity_blocks=100, block_size=BS, step_model=True))
    (j,) = jobs
    assert (j.done - j.first_token) / 49 == pytest.approx(ServiceModel().step_s(1))


# ---- the mix and the CLI --------------------------------------------------------------------------
def test_the_goodput_mix_shares_prefix_blocks_and_marks_classes():
    reqs = GoodputMixWorkload(rate=20.0, duration_s=10.0).generate(seed=0)
    kinds = {r.kind for r in reqs}
    assert kinds <= {"warmup", "chat", "rag", "batch"} and {"chat", "rag"} <= kinds
    rag = [r for r in reqs if r.kind == "rag"]
    firsts = {r.hashes[0] for r in rag}
    assert len(firsts) <= 8  # one document each: its first block is shared
    assert all(len(r.hashes) == -(-r.input_tokens // BS) for r in reqs)
    assert GoodputMixWorkload(rate=20.0, duration_s=10.0).generate(seed=0) == reqs  # deterministic


def test_pd_sweep_as_a_user_runs_it(tmp_path, capsys):
    out = tmp_path / "pd.json"
    rc = pd_sweep.main(["--replicas", "4", "--splits", "1:3", "--rate", "4", "--duration", "5",
                        "--seeds", "0", "1", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "colocated" in text and "1:3" in text and "seed 1 (reports)" in text
    rows = json.loads(out.read_text())["rows"]
    assert {(r["seed"], r["arm"]) for r in rows} == {(0, "colocated"), (0, "1:3"), (1, "colocated"), (1, "1:3")}
    for r in rows:
        assert not math.isnan(r["pd"]["tpot_p99_s"]) and r["pd"]["measured"] > 0
    assert pd_sweep.main(["--replicas", "4", "--splits", "2:3"]) == 2  # does not add up: refused
