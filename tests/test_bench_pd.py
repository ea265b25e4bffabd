"""`prefixgate bench pd` (loadtest/bench/pd_bench.py): the workload's split at the threshold
(pure), the hand-over counts folded from the decode replicas' polls (pure), and one short real
run through the CLI on sim replicas with the prefill replica killed: counts asserted, never
timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.local_redis import free_port
from loadtest.bench.pd_bench import HandoverTally, add_counts, parse_args, workload

ROOT = Path(__file__).resolve().parents[1]
PREFIXGATE = Path(sys.executable).parent / "prefixgate"


def test_long_prompts_pass_the_threshold_and_short_ones_do_not():
    args = parse_args(["--duration", "60", "--rate", "5"])
    schedule = workload(args)
    assert schedule == workload(args)  # seeded: each arm gets the same arrivals
    offsets = [o for o, _ in schedule]
    assert offsets == sorted(offsets) and offsets[-1] < 60 and 200 < len(schedule) < 400
    for _, r in schedule:
        n = len(r.prompt)
        assert (n > args.pd_threshold_tokens) == (r.cls == "long") and r.max_tokens == args.max_tokens
    assert 0.2 < sum(r.cls == "long" for _, r in schedule) / len(schedule) < 0.4
    with pytest.raises(SystemExit):
        parse_args(["--pd-threshold-tokens", "100"])  # the short prompts (up to 200) would pass it


def test_counts_and_latencies_folded_from_polls():
    """Only what each replica gained since the last read; its latency list keeps its last 100,
    so the new ok hand-overs' seconds are its tail."""
    tally = HandoverTally()
    zero = {"asked": 0, "ok": 0, "empty": 0, "timeouts": 0, "failed": 0, "tokens": 0, "bytes": 0, "latencies": []}
    first = {"a": {**zero, "asked": 3, "ok": 2, "failed": 1, "tokens": 64, "latencies": [0.1, 0.2]}}
    add_counts(tally, {"a": zero}, first)
    second = {"a": {**first["a"], "asked": 4, "ok": 3, "tokens": 96, "latencies": [0.1, 0.2, 0.3]},
              "b": {**zero, "asked": 1, "timeouts": 1}}  # a replica first seen now: all its counts are new
    add_counts(tally, first, second)
    assert tally.counts == {"asked": 5, "ok": 3, "empty": 0, "timeouts": 1, "failed": 1, "tokens": 96, "bytes": 0}
    assert tally.latencies == [0.1, 0.2, 0.3]


@pytest.mark.serve  # `prefixgate bench pd` starts its own stack (Ray, Redis, sim replicas) in a subprocess
def test_a_short_real_run_with_a_prefill_replica_killed(tmp_path):
    """Both arms on 1 + 1 sim replicas; the one prefill replica killed mid-run, so the long
    prompts sent while it is replaced are computed on the decode replica: none lost."""
    out = tmp_path / "pd.json"
    r = subprocess.run(
        [str(PREFIXGATE), "bench", "pd", "--prefill-replicas", "1", "--decode-replicas", "1", "--duration", "8",
         "--rate", "4", "--long-share", "0.5", "--kill-prefill-every", "6", "--port", str(free_port()),
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "CPU: " in r.stdout and "interrupted hand-overs recovered" in r.stdout
    arms = json.loads(out.read_text())["arms"]
    assert set(arms) == {"colocated", "split"}
    for arm in arms.values():
        assert arm["requests"] > 0 and arm["failed"] == 0, arm
    split = arms["split"]
    assert split["kills"] and split["kills"][0]["replica"]
    h = split["handover"]
    assert h["ok"] >= 1 and h["asked"] <= h["long_sent"] == split["long"]
    assert split["interrupted_recovered"] >= 1 and split["interrupted_recovered"] == h["failed"] + h["timeouts"]
    assert split["route_check"]["short"] == [False] * 4  # no short prompt handed over
    assert any(split["route_check"]["long"])
    assert split["prefill_idle"]["ok"], split["prefill_idle"]
