"""`prefixgate bench engine --against vllm`: the pure figures (medians, ratio, agreement), the
exit status without the vLLM venv, and one tiny comparison through the real vLLM CPU engine in
`.venv-vllm` (never timing thresholds: the machine is shared)."""

from __future__ import annotations

import json

import pytest

from loadtest.bench import engine_bench as bench
from loadtest.bench import vllm_bench as bench_vllm


def test_rounds_medians_and_ratio():
    r = bench_vllm.Rounds(ours_tok_s=[100.0, 130.0, 120.0], vllm_tok_s=[200.0, 190.0, 240.0])
    assert r.ours_median == 120.0 and r.vllm_median == 200.0
    assert r.ratio == pytest.approx(0.6)  # median over median, the issue's measure
    assert r.ratio_rounds == pytest.approx([0.5, 130 / 190, 0.5])


def test_leading_agreement_stops_at_the_first_difference():
    assert bench_vllm.leading_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 4
    assert bench_vllm.leading_agreement([1, 2, 9, 4], [1, 2, 3, 4]) == 2  # the later 4 does not count
    assert bench_vllm.leading_agreement([5], [6]) == 0
    assert bench_vllm.leading_agreement([1, 2], [1, 2, 3]) == 2
    assert bench_vllm.agreement([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == [2, 1]
    with pytest.raises(ValueError):
        bench_vllm.agreement([[1]], [[1], [2]])


def test_target_verdict_names_the_issue_targets():
    assert bench_vllm.target_verdict(16, 64, 0.59) == "target 16x64 >= 1.0x: NOT met (x0.59)"
    assert bench_vllm.target_verdict(64, 32, 1.31).endswith(": met (x1.31)")
    assert bench_vllm.target_verdict(2, 4, 1.0) is None


def test_missing_vllm_venv_exits_2_naming_make_install(tmp_path, capsys):
    missing = tmp_path / "no-venv" / "bin" / "python"
    assert bench.main(["--against", "vllm", "--vllm-python", str(missing)]) == bench_vllm.MISSING_EXIT == 2
    err = capsys.readouterr().err
    assert "make install" in err and str(missing) in err


@pytest.mark.vllm
@pytest.mark.slow
def test_against_vllm_tiny_comparison(default_model_dir, tmp_path, capsys):
    python = bench_vllm.interpreter()
    assert python is not None, bench_vllm.missing_message(None)
    out = tmp_path / "bench.json"
    argv = ["--model", default_model_dir, "--against", "vllm", "--vllm-eager", "--requests", "2", "--new-tokens", "4",
            "--rounds", "1", "--skip-baselines", "--check", "0", "--seed-new-tokens", "2", "--json", str(out)]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    vs = json.loads(out.read_text())["against_vllm"]

    assert vs["requests"] == 2 and vs["new_tokens"] == 4 and vs["dtype"] == "float32" and not vs["vllm_compiled"]
    assert len(vs["rounds"]["ours_tok_s"]) == len(vs["rounds"]["vllm_tok_s"]) == 1
    assert vs["ours_tok_s"] > 0 and vs["vllm_tok_s"] > 0
    assert vs["ratio"] == pytest.approx(vs["ours_tok_s"] / vs["vllm_tok_s"])
    for s, tok_s in zip(vs["vllm_s_rounds"], vs["rounds"]["vllm_tok_s"], strict=True):
        assert s * tok_s == pytest.approx(2 * 4)  # throughput is the measured round alone
    assert vs["vllm_ready_s"] >= vs["vllm_startup_s"] > 0 and vs["vllm_warmup_s"] > 0  # reported apart
    assert len(vs["agreement"]) == 2 and vs["agreement"][0] > 0
    seed = vs["seed"]
    assert seed["ours_warm_median_ms"] > 0 and seed["vllm_warm_median_ms"] > 0 and seed["vllm_source"]
    # block size 32: the 100-token system prompt gives 3 full blocks, hit by requests 2..10
    assert seed["vllm_cached_per_request"] == [0] + [96] * 9
    assert "ratio ours / vLLM" in printed and "vLLM start-up" in printed and "greedy agreement" in printed
    assert "vLLM's TTFT is" in printed
