"""The live routing audit (loadtest/live_audit.py): known answers from written records, then a
real stack recording with `audit_dir` and the audit read back through the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from loadtest.live_audit import audit_dir
from replica.default_model import DEFAULT_MODEL_NAME
from router.protocol.audit_log import AuditWriter, Blocks, Decision, Outcome
from router.protocol.messages import RouteDecision
from router.sim.audit import UNEXPLAINED

BS = 16
ROOT = Path(__file__).resolve().parents[1]
P, Q, R = [10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]


def _decision(t, rid, hashes, replica, chosen=None, seen=None, costs=None, reason="load") -> Decision:
    return Decision(t=t, request_id=rid, hashes=hashes, prompt_tokens=len(hashes) * BS + 1, replica=replica,
                    route=RouteDecision("affinity", reason, chosen or replica), seen=seen or {}, costs=costs or {},
                    balance_tokens=10.0)


def test_causes_from_records_add_up_to_the_gap(tmp_path):
    """Two replicas, A and B. P and Q are computed on A by their first requests; then a P
    request priced away from A by its load (`load`), a Q request Ray places on B although the
    policy chose A (`overflow`), a request for R while R's first request is still prefilling
    on A (`in_flight`), a Q request after A evicted Q (`capacity`), and a P request that hits."""
    router = AuditWriter.for_process(tmp_path, "router", "r")
    a = AuditWriter.for_process(tmp_path, "replica", "A")
    b = AuditWriter.for_process(tmp_path, "replica", "B")
    router.write(_decision(0.1, "p0", P + [9], "A"))
    a.write(Outcome(t=0.25, request_id="p0", replica="A", prompt_tokens=81, cached_tokens=0, first_token_t=0.2))
    a.write(Blocks(t=0.2, replica="A", op="+", hashes=P + [9]))
    router.write(_decision(0.3, "q0", Q + [8], "A"))
    a.write(Outcome(t=0.45, request_id="q0", replica="A", prompt_tokens=81, cached_tokens=0, first_token_t=0.4))
    a.write(Blocks(t=0.4, replica="A", op="+", hashes=Q + [8]))
    router.write(_decision(1.0, "p1", P + [1], "B", seen={"A": 4, "B": 0}, costs={"A": 500.0, "B": 100.0}))
    b.write(Outcome(t=1.2, request_id="p1", replica="B", prompt_tokens=81, cached_tokens=0, first_token_t=1.1))
    router.write(_decision(2.0, "q1", Q + [2], "B", chosen="A", seen={"A": 4, "B": 0}))
    b.write(Outcome(t=2.2, request_id="q1", replica="B", prompt_tokens=81, cached_tokens=0, first_token_t=2.1))
    router.write(_decision(3.0, "r0", R + [3], "A"))
    a.write(Outcome(t=6.5, request_id="r0", replica="A", prompt_tokens=81, cached_tokens=0, first_token_t=6.0))
    a.write(Blocks(t=6.0, replica="A", op="+", hashes=R + [3]))
    router.write(_decision(4.0, "r1", R + [4], "B", seen={"A": 0, "B": 0}))
    b.write(Outcome(t=4.5, request_id="r1", replica="B", prompt_tokens=81, cached_tokens=0, first_token_t=4.2))
    a.write(Blocks(t=5.0, replica="A", op="-", hashes=Q + [8]))
    router.write(_decision(7.0, "q2", Q + [5], "A", seen={"A": 0, "B": 0}))
    a.write(Outcome(t=7.5, request_id="q2", replica="A", prompt_tokens=81, cached_tokens=0, first_token_t=7.2))
    router.write(_decision(8.0, "p2", P + [6], "A", seen={"A": 4}, reason="prefix"))
    a.write(Outcome(t=8.5, request_id="p2", replica="A", prompt_tokens=81, cached_tokens=4 * BS, first_token_t=8.2))
    router.write(_decision(9.0, "lost", P + [7], "A"))  # no outcome: the run stopped first

    result = audit_dir(tmp_path, BS)
    s = result.summary
    assert result.decisions == 9 and result.unmatched == 1 and s.requests == 8
    causes = {r.cause for r in result.audit.records if r.cause}
    assert causes == {"load", "overflow", "in_flight"}
    assert s.pooled_hits == 20 and s.run_hits == 4 and s.gap == 16
    assert s.causes == {"capacity": 4, "load": 4, "overflow": 4, "in_flight": 4, UNEXPLAINED: 0}


def test_no_decisions_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="--audit-dir"):
        audit_dir(tmp_path, BS)
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "loadtest", "audit", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no routing decisions" in r.stderr


@pytest.fixture(scope="module")
def audited_app(stack, redis_server, tmp_path_factory):
    from gateway.config import AppConfig
    from tests.helpers.stack import side_app

    audit = tmp_path_factory.mktemp("audit")
    config = AppConfig.from_dict({
        "redis_url": redis_server.url, "key_prefix": f"la-{uuid.uuid4().hex[:6]}", "replicas": 2, "engine": "sim",
        "num_blocks": 512, "audit_dir": str(audit),  # as a Serve config sets it
        "sim_service": {"decode_step_s": 0.01, "prefill_overhead_s": 0.0}, "redis_timeout_s": 1.0,
    })
    with side_app(stack, "audited", config) as url:
        yield url, audit


def _complete(url: str, prompt: str) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": 4, "ignore_eos": True,
                         "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_live_run_is_audited_from_its_own_records(audited_app, tmp_path):
    """Requests sharing a system prompt, one after another, then a concurrent burst on another:
    every decision has its outcome, the audit's hits are the replicas' own cached tokens, a
    prefix the fleet holds is seen as held (no `capacity` loss for a repeat), and the causes add
    up to the gap. The CLI reads the same directory."""
    url, audit = audited_app
    system = "You are a careful assistant who answers questions about routing. " * 8
    other = "Summarise the following document for a busy reader, in plain words. " * 8
    usages = [_complete(url, f"{system} Question {k}: what is {k} plus {k}?")["usage"] for k in range(5)]
    with ThreadPoolExecutor(4) as pool:
        usages += [r["usage"] for r in pool.map(lambda k: _complete(url, f"{other} Part {k}."), range(4))]
    assert any(u["prompt_tokens_details"]["cached_tokens"] for u in usages[1:5])  # the system prompt was reused

    result = audit_dir(audit, BS)
    s = result.summary
    assert result.decisions == len(usages) and result.unmatched == 0
    cached = sorted(min(u["prompt_tokens_details"]["cached_tokens"] // BS, (u["prompt_tokens"] - 1) // BS)
                    for u in usages)
    assert sorted(r.realized for r in result.audit.records) == cached
    repeats = result.audit.records[1:5]  # the system prompt's repeats, each after the one before finished
    assert all(r.best >= r.pooled > 0 for r in repeats), [(r.best, r.pooled) for r in repeats]
    assert sum(s.causes.values()) == s.gap == s.pooled_hits - s.run_hits

    out = tmp_path / "audit.json"
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "loadtest", "audit", str(audit), "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"routing audit: {len(usages)} decisions" in r.stdout
    summary = json.loads(out.read_text())
    assert summary["gap_blocks"] == s.gap and summary["run_hits"] == s.run_hits


def test_compare_audit_flag_as_typed(tmp_path, monkeypatch):
    """`prefixgate loadtest compare --audit`: the flag reaches the command, and each policy's
    audit is read from its own folder over its run's window."""
    from loadtest import cli

    seen = {}
    monkeypatch.setattr(cli, "cmd_compare", lambda args: seen.setdefault("args", args) and 0)
    cli.main(["compare", "--policies", "affinity", "--audit"])
    assert seen["args"].audit is True

    w = AuditWriter.for_process(tmp_path / "affinity" / "audit", "router", "x")
    w.write(_decision(5.0, "a", P, "A"))
    a = AuditWriter.for_process(tmp_path / "affinity" / "audit", "replica", "A")
    a.write(Outcome(t=5.5, request_id="a", replica="A", prompt_tokens=65, cached_tokens=0))
    row = cli._audit(tmp_path / "affinity", 4.0, 6.0)
    assert row["decisions"] == 1 and row["requests"] == 1
    assert (tmp_path / "affinity" / "audit.txt").exists()
    assert cli._audit(tmp_path / "affinity", 7.0, 8.0) is None
