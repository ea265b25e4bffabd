"""Short form of `prefixgate bench router`: the work per routing decision does not grow with the
fleet. Counts, not timings: Redis commands per decision (those run inside the lookup script
included, from INFO commandstats) and replicas the policy scores, at 4 and 128 replicas."""

from __future__ import annotations

import json

import pytest

from loadtest.bench.router_bench import main

pytestmark = pytest.mark.redis  # the benchmark starts a redis-server


def test_commands_and_scored_replicas_do_not_grow_with_the_fleet(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["--replicas", "4,128", "--blocks", "20000", "--iterations", "200", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    small, large = results["4"], results["128"]
    assert small["redis_commands_per_decision"] == large["redis_commands_per_decision"]
    # 64-block prompts: one script, a SCARD per block, a few samples, the session GET
    assert large["redis_commands_by_name"]["scard"] == 64
    assert large["redis_commands_by_name"].get("srandmember", 0) <= 4
    # matched (at most 12) + session + 4 sampled for load, never the fleet
    assert large["replicas_scored_mean"] <= 17
