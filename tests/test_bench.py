"""Smoke test for `prefixgate bench engine` on a tiny random model: the figures it reports must
be consistent with each other (never timing: the machine is shared)."""

from __future__ import annotations

import json

import pytest

from loadtest.bench import engine_bench as bench

pytestmark = pytest.mark.slow  # the engine benchmark, short form


def test_bench_engine_figures_are_consistent(tiny_model_dirs, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--model", tiny_model_dirs["llama"], "--requests", "4", "--new-tokens", "4",
            "--system-tokens", "32", "--seed-new-tokens", "2", "--threads", "1", "--json", str(out)]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    figures = json.loads(out.read_text())

    seed = figures["seed_scenario"]
    assert sum(bench.SEED_QUESTION_LENGTHS) == 190 and all(10 <= n <= 28 for n in bench.SEED_QUESTION_LENGTHS)
    assert seed["prompt_tokens"] == 1190
    assert seed["computed_without_cache"] == 1190
    # block size 16: the 100-token system prompt gives 6 full blocks, hit by requests 2..10
    assert seed["cached_per_request"] == [0] + [96] * 9
    assert seed["computed_with_cache"] == 1190 - 9 * 96 < seed["computed_without_cache"]
    assert seed["hits"] == 9 and seed["requests"] == 10
    assert seed["outputs_equal"]
    assert "1190 - 9 x 96 = 326" in printed and "9/10" in printed

    tp = figures["throughput"]
    assert tp["requests"] == 4 and tp["new_tokens"] == 4
    assert tp["prompt_tokens"] == 4 * (32 + bench.QUESTION_TOKENS)
    assert tp["ours_cached_tokens"] % 16 == 0  # whole blocks only
    assert tp["checked"] == tp["matched"] == 4 and tp["mismatched_ids"] == []
    for who in ("ours", "generate_batch", "sequential"):
        assert tp[f"{who}_tok_s"] > 0
        assert abs(tp[f"{who}_tok_s"] * tp[f"{who}_s"] - 4 * 4) < 1e-6
    assert abs(tp["ratio_generate_batch"] - tp["ours_tok_s"] / tp["generate_batch_tok_s"]) < 1e-9
    assert "ours / generate_batch" in printed and "4/4 matched" in printed
    # the weights floor: every step reads every weight, so it is a lower bound on our own time
    assert tp["weights_step_s"] > 0
    assert abs(tp["weights_floor_s"] - tp["weights_step_s"] * tp["ours_steps"]) < 1e-9
    assert tp["weights_floor_s"] < tp["ours_s"]
    assert "weights floor" in printed
