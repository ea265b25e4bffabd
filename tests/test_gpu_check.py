"""scripts/gpu_check.sh in its CPU form (--smoke, Triton kernels interpreted): the script a CUDA
machine runs is no dead code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.engine, pytest.mark.slow]  # scripts/gpu_check.sh runs tiny models

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_smoke_runs_parity_and_throughput(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--smoke", "--json", str(out)],
        cwd=ROOT, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gpu_check: ok" in proc.stdout and "output tok/s" in proc.stdout
    report = json.loads(out.read_text())
    assert [r["family"] for r in report["parity"]] == ["llama", "qwen2", "qwen3", "mistral"]
    assert all(r["agreed"] == r["prompts"] for r in report["parity"])
    assert [r["dtype"] for r in report["kernel"]] == ["float32", "bfloat16"]  # Triton, interpreted
    assert all(r["ok"] for r in report["kernel"])
    tp = report["throughput"]
    assert tp["num_seqs"] == 8 and tp["device"] == "cpu"
    assert 8 * 10 <= tp["output_tokens"] <= 8 * 60  # every request ran to its own max_tokens
    assert abs(tp["output_tok_s"] * tp["seconds"] - tp["output_tokens"]) < 1e-6 * tp["output_tokens"]


def test_gpu_check_smoke_compiled_throughput(tmp_path):
    """--compile, the form a lent GPU runs for the compiled step: its graphs built at start, one per
    thread count the steps run on (on this CPU with more than one thread, the tiny model's small
    steps run on one: two graphs)."""
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--smoke", "--compile", "--skip-kernel", "--skip-parity",
         "--json", str(out)],
        cwd=ROOT, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tp = json.loads(out.read_text())["throughput"]
    graphs = 2 if tp["device"] == "cpu" and tp["threads"] > 1 else 1
    assert tp["compiled_graphs"] == graphs and tp["compile_s"] is not None  # compiled at start, before any request
    assert 8 * 10 <= tp["output_tokens"] <= 8 * 60


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_gpu_check_refuses_without_cuda():
    proc = subprocess.run([sys.executable, "-m", "loadtest.device.gpu_check", "--device", "cuda"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--smoke" in proc.stderr


def test_stream_check_smoke_measures_the_replica_path(tmp_path):
    """loadtest/device/stream_check.py in its CPU form: every path delivers every token, and
    the batched replica path sends fewer events than tokens only because it batches."""
    out = tmp_path / "stream_check.json"
    proc = subprocess.run([sys.executable, "-m", "loadtest.device.stream_check", "--smoke", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert [(r["streams"], r["path"]) for r in runs] == [
        (n, p) for n in (2, 4) for p in ("engine", "replica, interval 50 ms", "replica, interval 0 ms")]
    for r in runs:
        assert r["output_tokens"] == r["streams"] * report["max_tokens"]
        assert 1 <= r["events_per_request"] <= report["max_tokens"]
        assert (r["ratio_to_engine"] is None) == (r["path"] == "engine")
    engine = [r for r in runs if r["path"] == "engine"]
    assert all(r["events_per_request"] == report["max_tokens"] for r in engine)  # one output per token
