"""`prefixgate bench engine --thin` (loadtest/bench/host_time.py), typed as a user would at a tiny
size, ours only: one ms/step figure per row count, the CPU named. No timing thresholds: the
machine is shared."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.bench import host_time

pytestmark = pytest.mark.engine  # builds a thin model and runs our engine on it, in a subprocess

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a subprocess that imports torch and builds the model: a minute on the loaded machine
def test_thin_bench_prints_a_figure_per_row_count(tmp_path):
    out = tmp_path / "thin.json"
    cmd = [sys.executable, "-m", "gateway.cli", "bench", "engine", "--thin", "--thin-rows", "2", "3",
           "--rounds", "1", "--new-tokens", "4", "--threads", "1", "--json", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    table = {int(m[1]): float(m[2]) for m in re.finditer(r"^\s+(\d+)\s+(\d+\.\d)\s*$", r.stdout, re.MULTILINE)}
    assert sorted(table) == [2, 3] and all(ms > 0 for ms in table.values()), r.stdout
    assert f"CPU: {host_time.cpu_name()}" in r.stdout
    figures = json.loads(out.read_text())
    assert [m["rows"] for m in figures["medians"]] == [2, 3]
    assert all(m["vllm_ms_per_step"] is None for m in figures["medians"])
    # one prefill step and a decode step per further token
    assert [row["ours_steps"] for row in figures["rows"]] == [[4], [4]]


def test_row_figures_medians_and_ratio():
    r = host_time.RowFigures(16, ours_ms=[30.0, 20.0, 25.0], vllm_ms=[10.0, 12.0, 11.0])
    assert r.ours_median == 25.0 and r.vllm_median == 11.0 and r.ratio == 25.0 / 11.0
    assert host_time.RowFigures(16, ours_ms=[1.0]).ratio is None


def test_random_prompts_are_fixed_and_avoid_special_ids():
    a = host_time.random_prompts(4, 32, salt=1)
    assert a == host_time.random_prompts(4, 32, salt=1) != host_time.random_prompts(4, 32, salt=2)
    assert len(a) == 4 and {len(p) for p in a} == {32}
    assert min(min(p) for p in a) >= host_time.FIRST_PROMPT_ID and max(max(p) for p in a) < 2048
