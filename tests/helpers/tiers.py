"""Test tiers: what a test needs, as one pytest marker per test (tests/conftest.py applies them).

    pure     nothing below: plain Python, the simulator, tensors small enough to make by hand
    engine   a real model or engine (tiny or the bundled default); no Redis, Ray or vLLM
    redis    a real redis-server
    serve    a Ray Serve stack (Ray, Serve, Redis, replicas, gateway)
    cluster  more than one node: multi-node Ray, `ray up`, a Redis Cluster
    vllm     the vLLM venv (.venv-vllm)

A test's tier is the highest of what its fixtures need (FIXTURE_TIERS) and of any tier marker
it carries itself: a module that starts something without a fixture (a redis-server of its own,
`prefixgate serve` in a subprocess) says so with `pytestmark = pytest.mark.<tier>`, or on the one
test that does. `pytest -m "pure or engine"` is `make test-fast`.
"""

from __future__ import annotations

import pytest

TIERS = ("pure", "engine", "redis", "serve", "cluster", "vllm")  # lowest first

# tests/conftest.py's fixtures, by what each brings up (fixtures that use these inherit them:
# pytest lists a fixture's own fixtures in item.fixturenames)
FIXTURE_TIERS = {
    "tiny_model_dirs": "engine",
    "default_model_dir": "engine",
    "hf_reference": "engine",
    "redis_server": "redis",
    "redis_url": "redis",  # its "cluster" parameter: see tier_of
    "stack": "serve",
    "redis_cluster": "cluster",
}
# fixtures parametrized over what they start: (fixture, parameter value) -> tier
PARAM_TIERS = {("redis_url", "cluster"): "cluster"}


def rank(tier: str) -> int:
    return TIERS.index(tier)


def fixture_tier(fixturenames, params: dict | None = None) -> str:
    """The tier a test's fixtures need: the highest of them, `pure` when none needs anything."""
    found = [FIXTURE_TIERS[f] for f in fixturenames if f in FIXTURE_TIERS]
    for (name, value), tier in PARAM_TIERS.items():
        if name in fixturenames and (params or {}).get(name) == value:
            found.append(tier)
    return max(found, key=rank, default="pure")


def tier_of(fixturenames, params: dict | None = None, marked=()) -> str:
    """The test's tier: the highest of its fixtures' and of the tier markers it carries."""
    return max([fixture_tier(fixturenames, params), *(m for m in marked if m in TIERS)], key=rank)


def tier_markers(item) -> list[str]:
    """The tier markers a collected item carries (its own, its class's and its module's)."""
    return [m.name for m in item.iter_markers() if m.name in TIERS]


def item_params(item) -> dict:
    callspec = getattr(item, "callspec", None)
    return dict(callspec.params) if callspec is not None else {}


def record(item) -> dict:
    """What tests/test_tiers.py checks of one collected test."""
    return {"tiers": tier_markers(item), "needs": fixture_tier(item.fixturenames, item_params(item)),
            "marks": sorted({m.name for m in item.iter_markers()}), "fixtures": sorted(item.fixturenames)}


# every test the session collected (before -m/-k deselect any), nodeid -> record()
COLLECTED = pytest.StashKey[dict]()
