"""The policy registry (router/registry.py): one name per algorithm, read by the gateway, the
load tests and the docs. No Ray is started here: router_config only builds a config object."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from router import registry
from router.policy import POLICIES, Policy, make_policy

DOCS = Path(__file__).resolve().parents[1] / "docs" / "policies.md"


def test_names_ours_and_rays_apart():
    assert registry.policy_names(registry.OURS) == tuple(POLICIES)
    assert registry.policy_names(registry.RAY) == ("ray-pow2", "ray-prefix", "ray-session")
    assert registry.policy_names()[0] == registry.DEFAULT_POLICY
    assert registry.is_ours("pow2") and not registry.is_ours("ray-pow2")
    for e in registry.entries():
        assert e.summary and "\n" not in e.summary
        assert e.is_ours == (e.policy_class is not None)
        assert e.is_ours or e.name.startswith("ray-")


def test_unknown_name_lists_the_valid_ones():
    for call in (registry.resolve, registry.get, make_policy):
        with pytest.raises(ValueError) as e:
            call("round-robin")
        for name in registry.policy_names():
            assert name in str(e.value)


def test_aliases_resolve_to_canonical_names():
    assert registry.aliases()  # the test means something
    for alias, name in registry.aliases().items():
        assert registry.resolve(alias) == name
        assert name in registry.policy_names()
    assert registry.resolve("ray-default") == "ray-pow2"
    assert make_policy("power-of-two", seed=0).name == "pow2"
    assert registry.resolve_list(" affinity, ray-default ,,pow2") == ["affinity", "ray-pow2", "pow2"]
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        registry.resolve_list("affinity,nope")


def test_a_name_is_registered_once():
    with pytest.raises(ValueError, match="registered twice"):
        @registry.register_policy(summary="x")
        class Again(Policy):
            name = "affinity"
    with pytest.raises(ValueError, match="registered twice"):
        @registry.register_policy(summary="x", aliases=("ray-default",))
        class Aliased(Policy):
            name = "brand-new"
    assert "brand-new" not in registry.policy_names()


@pytest.mark.parametrize("name", registry.policy_names(registry.OURS))
def test_every_policy_of_ours_builds(name):
    p = make_policy(name, seed=0)
    assert isinstance(p, registry.get(name).policy_class) and p.name == name


@pytest.mark.parametrize("name", registry.policy_names(registry.RAY))
def test_rays_are_not_ours_to_build_and_simulate_as_ours(name):
    with pytest.raises(ValueError, match="Ray Serve's router"):
        make_policy(name)
    assert registry.is_ours(registry.sim_policy(name))


def test_pow2_is_one_algorithm_served_and_simulated():
    """pow2 served goes through PrefixGateRouter with our PowerOfTwoPolicy, over the whole fleet
    as the simulator gives it; Ray's default router is ray-pow2, simulated by ours."""
    assert registry.get("pow2").policy_class.__name__ == "PowerOfTwoPolicy"
    assert POLICIES["pow2"].needs_all_replicas
    assert registry.get("ray-pow2").ray_router is None
    assert registry.sim_policy("ray-pow2") == "pow2"


def test_served_pow2_draws_from_the_whole_fleet():
    """Through the router's Decider (what PrefixGateRouter runs), pow2 picks its two among all
    replicas, not among the index's matches plus a few sampled ones: a matched replica is not
    favoured, as it is not in the simulator."""
    import asyncio
    import time

    from router.decider import Decider, InflightPrefixes
    from router.index.redis_index import Lookup, RedisConfig, RedisIndex, ReplicaEntry
    from router.load_table import LoadTable
    from router.policy import RouteRequest

    ids = [f"r{i}" for i in range(200)]
    table = LoadTable(RedisIndex(RedisConfig("redis://127.0.0.1:1/0", timeout_s=0.01)), refresh_s=60.0, seed=0)
    table._loads = {rid: {"running": 0, "waiting": 0, "pending_prefill_tokens": 0, "free_blocks": 100,
                          "cached_blocks": 0, "capacity_blocks": 100} for rid in ids}
    table.updated_at = time.monotonic()
    decider = Decider(make_policy("pow2", seed=1), table, InflightPrefixes(3.0), sampled=4)
    route = RouteRequest(list(range(16)), 256, 16, None)

    async def picks() -> list[str]:
        try:
            return [decider.score(route, ids, Lookup(None, {"r7": ReplicaEntry(10)}), lambda rid: 0).decision.replica_id
                    for _ in range(300)]
        finally:
            await table.close()

    chosen = asyncio.run(picks())
    assert len(set(chosen)) > 100 and chosen.count("r7") < 10


def test_app_config_validates_and_canonicalises():
    from gateway.config import AppConfig

    assert AppConfig(policy="ray-default").policy == "ray-pow2"
    assert AppConfig.from_dict({"policy": "power-of-two"}).policy == "pow2"
    with pytest.raises(ValueError, match="unknown policy 'bogus'; valid: affinity"):
        AppConfig(policy="bogus")


def test_router_config_for_ours_and_rays():
    from gateway.app import router_config
    from gateway.config import AppConfig

    rc = router_config(AppConfig(policy="pow2", key_prefix="k", seed=3), "m")
    assert rc.request_router_class == registry.OUR_ROUTER_CLASS
    assert rc.request_router_kwargs["policy"] == "pow2"
    assert rc.request_router_kwargs["key_prefix"] == "k" and rc.request_router_kwargs["model_id"] == "m"
    rc = router_config(AppConfig(policy="ray-prefix"), "m")
    assert rc.request_router_class.endswith("PrefixCacheAffinityRouter") and not rc.request_router_kwargs
    assert router_config(AppConfig(policy="ray-pow2"), "m") is None  # Serve's default router
    for name in registry.policy_names():  # every registered name builds a config
        router_config(AppConfig(policy=name), "m")


def test_serve_cli_takes_registry_names_only(capsys):
    from gateway.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--policy", "bogus"])
    assert e.value.code == 2 and "ray-pow2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "ray-pow2" in capsys.readouterr().out


def test_loadtest_defaults_are_registered_names():
    from loadtest.cli import DEFAULT_COMPARE
    from loadtest.fleet import FLEET_POLICIES

    for name in (*DEFAULT_COMPARE, *FLEET_POLICIES):
        assert registry.resolve(name) == name


def test_loadtest_compare_refuses_unknown_policies(capsys):
    from loadtest.cli import main

    assert main(["compare", "--policies", "affinity,bogus"]) == 2
    assert "valid: affinity" in capsys.readouterr().err


def test_ray_names_simulate_as_their_stand_in():
    from loadtest.fleet_report import RunSettings, sim_result
    from router.sim.trace import scale_rows

    rows = [{"timestamp": 1000 * i, "input_length": 1200, "output_length": 4, "hash_ids": [0, 1, i % 3 + 2]}
            for i in range(12)]
    reqs = scale_rows(rows, 16, 4)
    s = RunSettings(replicas=2, capacity_blocks=64)
    ray, ours = sim_result("ray-pow2", reqs, s), sim_result("pow2", reqs, s)
    assert ray.policy == "ray-pow2" and ours.policy == "pow2"
    assert (ray.hit_blocks, ray.ttft_p99_s, ray.reasons) == (ours.hit_blocks, ours.ttft_p99_s, ours.reasons)


def test_docs_table_is_the_registry():
    text = DOCS.read_text()
    m = re.search(r"<!-- policies:begin[^>]*-->\n(.*?)\n<!-- policies:end -->", text, re.S)
    assert m, "docs/policies.md lost its table markers"
    assert m.group(1) == registry.markdown_table(), "regenerate: .venv/bin/python -m router.registry"
    listed = re.findall(r"^\| `([^`]+)` \|", m.group(1), re.M)
    assert listed == list(registry.policy_names())


def test_registry_imports_neither_torch_nor_ray():
    code = ("import sys, router.registry as r, gateway.config as c; r.policy_names(); c.AppConfig(policy='pow2'); "
            "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout
    assert out.strip() == "[]"
