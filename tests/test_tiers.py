"""The tier markers (tests/helpers/tiers.py, applied by tests/conftest.py): every test carries
exactly one, it is at least what its fixtures need, and the known cases land where they belong.
Also the layout rule of tests/: shared helpers come from tests/helpers only."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.tiers import COLLECTED, FIXTURE_TIERS, TIERS, fixture_tier, rank, tier_of

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


# ---- the rule ------------------------------------------------------------------------------------
def test_fixtures_map_to_the_highest_tier_they_need():
    assert fixture_tier([]) == "pure"
    assert fixture_tier(["tmp_path", "monkeypatch", "capsys"]) == "pure"
    assert fixture_tier(["tiny_model_dirs"]) == "engine"
    assert fixture_tier(["default_model_dir", "hf_reference"]) == "engine"
    assert fixture_tier(["redis_server", "tiny_model_dirs"]) == "redis"
    assert fixture_tier(["stack", "redis_server"]) == "serve"
    assert fixture_tier(["stack", "redis_server", "redis_cluster"]) == "cluster"
    assert fixture_tier(["redis_url"], {"redis_url": "standalone"}) == "redis"
    assert fixture_tier(["redis_url"], {"redis_url": "cluster"}) == "cluster"


def test_a_tier_marker_raises_the_tier_and_never_lowers_it():
    assert tier_of([], marked=["redis"]) == "redis"  # a module that starts its own redis-server
    assert tier_of(["tiny_model_dirs"], marked=["serve"]) == "serve"
    assert tier_of(["stack"], marked=["redis"]) == "serve"  # its fixtures need more than it says
    assert tier_of(["tmp_path"], marked=["slow", "timeout"]) == "pure"  # other markers are no tier
    assert [rank(t) for t in TIERS] == list(range(len(TIERS)))


def test_every_conftest_fixture_has_a_tier():
    """A fixture added to conftest.py must say what it brings up (FIXTURE_TIERS); fixtures that
    need nothing are listed here."""
    needs_nothing: set[str] = set()
    tree = ast.parse((TESTS / "conftest.py").read_text())
    fixtures = {
        node.name for node in tree.body if isinstance(node, ast.FunctionDef)
        and any("fixture" in ast.unparse(d) for d in node.decorator_list)
    }
    assert fixtures, "no fixtures found in conftest.py"
    assert fixtures - needs_nothing <= set(FIXTURE_TIERS), fixtures - needs_nothing - set(FIXTURE_TIERS)
    assert set(FIXTURE_TIERS) <= fixtures, "FIXTURE_TIERS names a fixture conftest.py no longer has"


def test_tier_markers_are_registered(pytestconfig):
    registered = {line.split(":")[0].strip() for line in pytestconfig.getini("markers")}
    assert set(TIERS) | {"slow"} <= registered


# ---- the collected suite ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def collected(request, tmp_path_factory) -> dict[str, dict]:
    """Every test of tests/ with its tier record: this session's own collection when it took in
    the whole suite (make test, make test-fast), else a --collect-only run of tests/."""
    modules = {p.name for p in TESTS.glob("test_*.py")}
    records = request.config.stash.get(COLLECTED, {})
    if modules <= {nodeid.split("::")[0].rsplit("/", 1)[-1] for nodeid in records}:
        return records
    out = tmp_path_factory.mktemp("tiers") / "tiers.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly", "-p", "tests.helpers.tier_report",
         str(TESTS)],
        cwd=ROOT, env={**os.environ, "PREFIXGATE_TIER_REPORT": str(out)}, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_every_test_module_is_collected(collected):
    seen = {nodeid.split("::")[0].rsplit("/", 1)[-1] for nodeid in collected}
    assert {p.name for p in TESTS.glob("test_*.py")} <= seen


def test_every_test_has_exactly_one_tier_at_least_what_its_fixtures_need(collected):
    wrong = {nodeid: r["tiers"] for nodeid, r in collected.items() if len(r["tiers"]) != 1}
    assert not wrong, f"tests without exactly one tier marker: {wrong}"
    low = {nodeid: (r["tiers"][0], r["needs"]) for nodeid, r in collected.items() if rank(r["tiers"][0]) < rank(r["needs"])}
    assert not low, f"tier below what the fixtures need: {low}"
    assert {r["tiers"][0] for r in collected.values()} == set(TIERS)  # every tier has tests


def _tier(collected: dict, nodeid_start: str) -> set[str]:
    found = {r["tiers"][0] for nodeid, r in collected.items() if nodeid.startswith(nodeid_start)}
    assert found, f"no test collected as {nodeid_start}"
    return found


@pytest.mark.parametrize("nodeid, tier", [
    # from the fixtures
    ("tests/test_block_hash.py::", "pure"),
    ("tests/test_engine.py::test_real_model_matches_transformers", "engine"),  # default_model_dir, hf_reference
    ("tests/test_engine_api.py::test_top_k_one_is_greedy", "engine"),  # tiny_model_dirs
    ("tests/test_degraded_routing.py::test_a_timed_out_lookup_keeps_the_load_table", "redis"),  # redis_server
    ("tests/test_replica_loop.py::test_loop_answers_during_a_long_prefill", "redis"),  # redis_server, default_model_dir
    ("tests/test_redis_index.py::test_publish_lookup_evict_and_isolation[standalone]", "redis"),  # redis_url
    ("tests/test_redis_index.py::test_publish_lookup_evict_and_isolation[cluster]", "cluster"),
    ("tests/test_gateway_e2e.py::", "serve"),  # stack
    ("tests/test_gateway_cluster.py::", "cluster"),  # stack and redis_cluster
    # from the module's or the test's own marker
    ("tests/test_redis_security.py::", "redis"),  # its own redis-servers
    ("tests/test_redis_index.py::test_resync_after_redis_restart_and_fast_failure_while_down", "redis"),
    ("tests/test_shutdown.py::", "serve"),  # `prefixgate serve` in a subprocess
    ("tests/test_light_processes.py::test_chat_sessions_hit_their_cache", "serve"),  # the stack, through its fixture
    ("tests/test_ray_up.py::", "cluster"),
    ("tests/test_infra.py::test_multinode_cluster_routes_session_back_to_worker_replica", "cluster"),
    ("tests/test_vllm_backend.py::", "vllm"),
    ("tests/test_bench_vllm.py::test_against_vllm_tiny_comparison", "vllm"),
    ("tests/test_engine_bf16.py::", "engine"),  # tiny models of its own
])
def test_known_cases(collected, nodeid, tier):
    assert _tier(collected, nodeid) == {tier}


def test_slow_marker_still_applies(collected):
    assert "slow" in collected["tests/test_soak.py::test_step_loop_soak_with_aborts"]["marks"]  # decorator
    fuzz = [r for nodeid, r in collected.items() if nodeid.startswith("tests/test_fuzz_api.py::")]
    assert fuzz and all("slow" in r["marks"] for r in fuzz)  # module pytestmark


def test_the_fast_tiers_need_no_service(collected):
    fast = {nodeid: r for nodeid, r in collected.items() if r["tiers"][0] in ("pure", "engine")}
    assert len(fast) >= 300
    services = {f for f, t in FIXTURE_TIERS.items() if rank(t) > rank("engine")}
    leaks = {nodeid: sorted(services & set(r["fixtures"])) for nodeid, r in fast.items() if services & set(r["fixtures"])}
    assert not leaks


# ---- the layout -------------------------------------------------------------------------------
def _imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def test_helpers_come_from_tests_helpers_only():
    """No test module, helper or conftest.py imports another test module or conftest.py."""
    files = [*TESTS.glob("test_*.py"), *TESTS.glob("helpers/*.py"), TESTS / "conftest.py"]
    bad = {}
    for path in files:
        wrong = {m for m in _imported_modules(path)
                 if m == "tests.conftest" or m.startswith("tests.test_") or (m.startswith("tests.") and not m.startswith("tests.helpers"))}
        if wrong:
            bad[path.name] = sorted(wrong)
    assert not bad


def test_conftest_and_helpers_load_without_torch():
    code = ("import sys, tests.conftest, tests.helpers.engine, tests.helpers.tiers; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ---- make test's workers (tests/helpers/workers.py) ------------------------------------------------
class _Item:
    """Only what workers.share reads and writes of a pytest item."""

    def __init__(self, nodeid: str, fixtures=()):
        self.nodeid, self.fixturenames, self.stash = nodeid, list(fixtures), {}


def test_workers_split_the_stack_modules_by_their_seconds_and_start_the_heaviest_units_first():
    from tests.helpers.workers import STACK_UNIT, share, unit_name

    items = [
        _Item("tests/test_a.py::one"), _Item("tests/test_a.py::two"),
        _Item("tests/test_b.py::uses", ["stack"]), _Item("tests/test_b.py::plain"),
        _Item("tests/test_c.py::vllm"),
        _Item("tests/test_d.py::uses", ["redis_server", "stack"]),
        _Item("tests/test_e.py::uses", ["stack"]),
        _Item("tests/test_f.py::new"),  # not recorded yet: priced by its tier
    ]
    tiers = {"tests/test_a.py": "pure", "tests/test_b.py": "serve", "tests/test_c.py": "vllm", "tests/test_d.py": "serve",
             "tests/test_e.py": "serve", "tests/test_f.py": "cluster"}
    recorded = {"tests/test_a.py": 1.0, "tests/test_b.py": 100.0, "tests/test_c.py": 50.0, "tests/test_d.py": 60.0,
                "tests/test_e.py": 30.0}
    units = share(items, lambda item: tiers[item.nodeid.split("::")[0]], 2, recorded)
    unit = {i.nodeid: unit_name(i) for i in items}
    assert units == {i.nodeid.split("::")[0]: unit[i.nodeid] for i in items}  # what the controller's scheduler reads
    # a module's tests share a unit, the stack's modules too; the stack's modules make two units
    # of near-equal seconds (100 | 60 + 30), one per worker
    assert unit["tests/test_b.py::uses"] == unit["tests/test_b.py::plain"] == f"{STACK_UNIT}-0"
    assert unit["tests/test_d.py::uses"] == unit["tests/test_e.py::uses"] == f"{STACK_UNIT}-1"
    assert unit["tests/test_a.py::one"] == unit["tests/test_a.py::two"] == "tests/test_a.py"
    # heaviest unit first (100, 90, 50, 20 by its tier, 1); the collected order inside a unit
    assert [i.nodeid for i in items] == [
        "tests/test_b.py::uses", "tests/test_b.py::plain", "tests/test_d.py::uses", "tests/test_e.py::uses",
        "tests/test_c.py::vllm", "tests/test_f.py::new", "tests/test_a.py::one", "tests/test_a.py::two"]


def test_the_record_reads_a_durations_report():
    from tests.helpers.workers import recorded_seconds, seconds_from_report

    report = ("============ slowest durations ============\n"
              "12.50s call     tests/test_x.py::test_one[a-b]\n"
              "2.00s setup    tests/test_x.py::test_one[a-b]\n"
              "0.50s teardown tests/test_y.py::Case::test_two\n"
              "(3 durations < 0.005s hidden.)\n")
    assert seconds_from_report(report) == {"tests/test_x.py": 14.5, "tests/test_y.py": 0.5}
    record = recorded_seconds()  # the checked-in record names modules that exist
    assert record and {Path(ROOT / m).exists() for m in record} == {True}


def test_make_test_runs_the_workers_with_their_units():
    """The Makefile's pytest-xdist options: loadscope (its scopes are our units: workers.py)
    without xdist's own reordering by test count (the order share() chose)."""
    make = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    line = next(ln for ln in make.stdout.splitlines() if "pytest" in ln)
    assert "-n 2 --dist loadscope --no-loadscope-reorder" in line, line
    make = subprocess.run(["make", "-n", "test", "TEST_WORKERS=0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    line = next(ln for ln in make.stdout.splitlines() if "pytest" in ln)
    assert "-n" not in line.split() and "--dist" not in line, line
