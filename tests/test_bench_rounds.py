"""`prefixgate bench engine --rounds 3 --skip-sequential` on a tiny model: three interleaved
rounds, medians consistent with the rounds (never timing: the machine is shared)."""

from __future__ import annotations

import json
import statistics

import pytest

from loadtest.bench import engine_bench as bench

pytestmark = pytest.mark.slow  # the engine benchmark, short form


def test_interleaved_rounds_report_medians(tiny_model_dirs, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--model", tiny_model_dirs["llama"], "--requests", "3", "--new-tokens", "3", "--system-tokens", "16",
            "--seed-new-tokens", "1", "--threads", "1", "--rounds", "3", "--skip-sequential", "--check", "2",
            "--json", str(out)]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    tp = json.loads(out.read_text())["throughput"]
    assert len(tp["ours_tok_s_rounds"]) == len(tp["generate_batch_tok_s_rounds"]) == len(tp["ratio_rounds"]) == 3
    assert tp["ours_tok_s"] == statistics.median(tp["ours_tok_s_rounds"])
    assert tp["generate_batch_tok_s"] == statistics.median(tp["generate_batch_tok_s_rounds"])
    assert abs(tp["ratio_generate_batch"] - statistics.median(tp["ratio_rounds"])) < 1e-12
    assert abs(tp["ours_tok_s"] * tp["ours_s"] - 9) < 1e-6  # the median round's own seconds
    assert tp["sequential_tok_s"] is None and tp["checked"] == tp["matched"] == 2
    assert "3 interleaved rounds" in printed and "of this CPU's limit" in printed
