"""Load test tooling: the summary math on hand-made records, the synthetic workloads, and one
short Locust run (chat + trace users) against the real stack."""

from __future__ import annotations

import json

import pytest

from loadtest.cli import LoadSpec, main, spec_from_args
from loadtest.summary import format_table, load_records, percentile, summarize, timeline
from loadtest.workload import (
    TraceSpec,
    hash_block,
    rng_for,
    scale_row,
    system_prompt,
    user_message,
)


def rec(ts, prompt, cached, *, ok=True, turn=None, replica="a", prev=None, ttft=0.1, lat=1.0, out=10, session=None):
    return {"ts": ts, "ok": ok, "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": out,
            "ttft_s": ttft, "tpot_s": 0.05, "latency_s": lat, "replica": replica, "prev_replica": prev,
            "turn": turn, "session": session, "error": None if ok else "HTTP 429: busy", "route": "session"}


# ---- summary ----------------------------------------------------------------------------------
def test_percentile_interpolates_like_numpy():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(range(101), 99) == pytest.approx(99.0)
    assert percentile([10, 0], 25) == 2.5  # order does not matter


def test_summary_hit_rate_prefill_stickiness_and_errors():
    records = [
        rec(100.0, 400, 0, turn=1, replica="a", session="s1", ttft=0.5),
        rec(101.0, 500, 384, turn=2, replica="a", prev="a", session="s1", ttft=0.1),
        rec(102.0, 600, 256, turn=3, replica="b", prev="a", session="s1", ttft=0.3),
        rec(103.0, 300, 0, turn=1, replica="b", session="s2", ttft=0.2),
        rec(104.0, 350, 288, turn=2, replica="b", prev="b", session="s2", ttft=0.1, lat=2.0),
        rec(104.5, 999, 999, ok=False, turn=3, replica=None, prev="b", session="s2", ttft=None, out=0),
        {**rec(105.0, 0, 0, ok=False, ttft=None, out=0, lat=0.5), "aborted": True, "error": "cut off"},
    ]
    s = summarize(records, "affinity")
    assert s["policy"] == "affinity"
    assert (s["requests"], s["ok"], s["errors"], s["aborted"]) == (7, 5, 1, 1)
    assert s["error_kinds"] == {"HTTP 429: busy": 1}
    assert s["prompt_tokens"] == 2150 and s["cached_tokens"] == 928  # the failed one not counted
    assert s["hit_rate"] == pytest.approx(928 / 2150)
    assert s["prefill_tokens"] == 2150 - 928
    assert s["later_turn_hit_rate"] == pytest.approx((384 + 256 + 288) / (500 + 600 + 350))
    assert s["later_turn_prefill_tokens"] == (500 - 384) + (600 - 256) + (350 - 288)
    assert (s["session_turns"], s["stayed"]) == (3, 2)  # turn 3 of s1 moved a -> b
    assert s["stickiness"] == pytest.approx(2 / 3)
    assert s["ttft_p50_s"] == pytest.approx(0.2)
    assert s["ttft_p99_s"] == pytest.approx(percentile([0.5, 0.1, 0.3, 0.2, 0.1], 99))
    assert s["duration_s"] == pytest.approx(106.0 - 100.0)  # last send 104 + its 2 s
    assert s["output_tokens_per_s"] == pytest.approx(50 / 6.0)
    assert s["replicas"] == {"a": 2, "b": 3}


def test_summary_of_nothing_and_of_single_turn_traffic():
    s = summarize([])
    assert s["requests"] == 0 and s["hit_rate"] is None and s["stickiness"] is None and s["timeline"] == []
    s = summarize([rec(1.0, 100, 50), rec(2.0, 100, 0)])
    assert s["hit_rate"] == 0.25 and s["stickiness"] is None and s["later_turn_hit_rate"] is None


def test_timeline_bins_by_send_time():
    records = [rec(0.0, 100, 0), rec(5.0, 100, 100), rec(12.0, 100, 50, ttft=1.0), rec(13.0, 1, 1, ok=False)]
    bins = timeline(records, bin_s=10.0)
    assert [b["t_s"] for b in bins] == [0.0, 10.0]
    assert bins[0]["hit_rate"] == 0.5 and bins[0]["requests"] == 2
    assert bins[1]["hit_rate"] == 0.5 and bins[1]["errors"] == 1 and bins[1]["ttft_p50_s"] == 1.0


def test_table_and_records_file(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(rec(1.0, 10, 5)) + "\n\n" + json.dumps(rec(2.0, 10, 5)) + "\n{torn")
    records = load_records(path)
    assert len(records) == 2
    rows = [summarize(records, "affinity"), summarize([], "pow2")]
    text = format_table(rows)
    assert "affinity" in text and "50.0%" in text and "pow2" in text
    md = format_table(rows, markdown=True)
    assert md.splitlines()[0].startswith("| policy |") and md.count("\n") == 3
    assert load_records(tmp_path / "missing.jsonl") == []


# ---- workloads --------------------------------------------------------------------------------
def test_chat_text_is_deterministic_and_prompts_differ_early():
    assert system_prompt(0, 3, 100) == system_prompt(0, 3, 100)
    a, b = system_prompt(0, 1, 100), system_prompt(0, 2, 100)
    assert a != b and a[:30] != b[:30]
    assert abs(len(a.split()) - 100) < 20
    assert user_message(rng_for(1, "u"), 20) == user_message(rng_for(1, "u"), 20)
    assert user_message(rng_for(1, "u"), 20) != user_message(rng_for(2, "u"), 20)


def test_trace_rows_map_equal_hash_ids_to_equal_tokens():
    spec = TraceSpec("unused", block_tokens=8, max_prompt_tokens=40, max_output_tokens=5, speedup=2.0)
    r0 = scale_row({"timestamp": 1000, "input_length": 1500, "output_length": 700, "hash_ids": [0, 1, 2]}, 0, spec, 1000)
    r1 = scale_row({"timestamp": 5000, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 7]}, 1, spec, 1000)
    r2 = scale_row({"timestamp": 9000, "input_length": 99999, "output_length": 3, "hash_ids": list(range(20))}, 2, spec, 1000)
    assert len(r0.prompt) == 24  # ceil(1500 * 8 / 512) = 24 = 3 blocks of 8
    assert len(r1.prompt) == 18  # ceil(1100 * 8 / 512)
    assert r0.prompt[:16] == r1.prompt[:16] == hash_block(0, 0, 8) + hash_block(0, 1, 8)
    assert r0.prompt[16:24] != r1.prompt[16:24]
    assert len(r2.prompt) == 40  # capped
    assert (r0.max_tokens, r1.max_tokens) == (5, 1)  # scaled 700 -> 11, capped at 5; 3 -> 1
    assert (r0.at_s, r1.at_s) == (0.0, 2.0)  # (5000 - 1000) ms / 1000 / speedup 2


def test_spec_from_args_preset_then_flags():
    import argparse

    ns = argparse.Namespace(preset="small", users=7, turns=None, workload=None)
    spec = spec_from_args(ns)
    assert spec.users == 7 and spec.turns == 7 and spec.workload == "chat"
    argv = LoadSpec(workload="chat,trace").locust_argv("http://x", __import__("pathlib").Path("/tmp/o"), "p")
    assert argv[-2:] == ["ChatUser", "TraceUser"] and "--records" in argv
    with pytest.raises(ValueError):
        LoadSpec(workload="bogus").user_classes()


# ---- a real run -------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_short_locust_run_against_the_stack(stack, tmp_path):
    """2 users (one chat of 3 turns, 4 trace rows) through the real gateway: the summary exists,
    nothing failed, and later chat turns were served from the prefix cache."""
    out = tmp_path / "run"
    code = main([
        "run", "--url", stack.url, "--workload", "chat,trace", "-u", "2", "-r", "2", "-t", "90",
        "--turns", "3", "--sessions-per-user", "1", "--max-tokens", "8", "--think-min", "0.1",
        "--think-max", "0.3", "--system-tokens", "120", "--user-tokens", "16", "--trace-requests", "4",
        "--trace-max-output", "4", "--seed", "7", "--out", str(out), "--label", "affinity",
    ])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    records = load_records(out / "records.jsonl")
    assert summary["errors"] == 0, summary["error_kinds"]
    chat = sorted((r for r in records if r["user"] == "ChatUser"), key=lambda r: r["turn"])
    trace = [r for r in records if r["user"] == "TraceUser"]
    assert [r["turn"] for r in chat] == [1, 2, 3] and len(trace) == 4
    assert all(r["replica"] and r["ttft_s"] > 0 and r["completion_tokens"] > 0 for r in records)
    assert all(r["cached_tokens"] > 0 for r in chat[1:]), [r["cached_tokens"] for r in chat]
    assert summary["cached_tokens"] > 0 and 0 < summary["hit_rate"] < 1
    assert summary["stickiness"] == 1.0  # affinity keeps a session where its history is
    assert (out / "locust_stats.csv").exists()
    assert "TTFT" in (out / "locust_stats.csv").read_text()
