"""Fixtures and hooks only: tiny random models of several families, the real default model,
Redis, the Ray Serve stack; the tier markers (tests/helpers/tiers.py); the work units of
make test's workers (tests/helpers/workers.py). Helpers the test modules
share live in tests/helpers/. torch loads in the fixtures that need it, not here: a pure test
does not pay for it."""

from __future__ import annotations

import os
import sys
import warnings

import pytest

from tests.helpers.tiers import (
    COLLECTED,
    FIXTURE_TIERS,
    item_params,
    rank,
    record,
    tier_markers,
    tier_of,
)
from tests.helpers.workers import (
    STACK_UNIT,
    UNITS_FILE,
    hand_over,
    share,
    unit_name,
    unit_scheduling,
    worker_count,
)

TORCH_THREADS = min(2, os.cpu_count() or 1)
_threads_set = False
_STACKS: list = []  # the session's stack, once started
_stopped_early: list[str] = []  # the stack unit after which this worker stopped it


def _torch():
    """torch, its thread count set for the suite (once, as the import at load time used to)."""
    global _threads_set
    import torch

    if not _threads_set:
        torch.set_num_threads(TORCH_THREADS)
        _threads_set = True
    return torch


# ---- hooks ----------------------------------------------------------------------------------
@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker: the tiers must be on by then
def pytest_collection_modifyitems(config, items):
    """One tier marker per test, from the fixtures it uses and the tier markers it carries
    (tests/helpers/tiers.py); every collected test's record goes to the stash for
    tests/test_tiers.py."""
    collected = config.stash.setdefault(COLLECTED, {})
    tiers = {}
    for item in items:
        tier = tier_of(item.fixturenames, item_params(item), tier_markers(item))
        if tier not in tier_markers(item):
            item.add_marker(getattr(pytest.mark, tier))
        collected[item.nodeid] = record(item)
        tiers[item.nodeid] = tier
    if os.environ.get("PYTEST_XDIST_WORKER"):  # make test's workers (tests/helpers/workers.py)
        units = share(items, lambda item: tiers[item.nodeid], worker_count())
        if os.environ.get(UNITS_FILE):
            hand_over(units)


class _RuntimeFixtureTiers:
    """A fixture asked for by name at run time (request.getfixturevalue) is not among the test's
    fixturenames, so it did not count for the tier: warn when it needs a higher one. A plugin of
    its own, not a conftest hook: session fixtures set up outside this directory's hooks."""

    def pytest_fixture_setup(self, fixturedef, request):
        need = FIXTURE_TIERS.get(fixturedef.argname)
        item = getattr(request, "_pyfuncitem", None)
        if need is None or item is None:
            return
        marked = tier_markers(item)
        if marked and rank(need) > max(rank(t) for t in marked):
            warnings.warn(pytest.PytestWarning(
                f"{item.nodeid} is marked {marked[0]} but sets up `{fixturedef.argname}` ({need}): "
                f"mark its module `pytestmark = pytest.mark.{need}` (tests/helpers/tiers.py)"), stacklevel=1)


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        # the controller of make test's workers: where they hand it their units (workers.py)
        import tempfile

        os.environ[UNITS_FILE] = os.path.join(tempfile.mkdtemp(prefix="prefixgate-units-"), "units.json")
    if not config.pluginmanager.has_plugin("prefixgate-runtime-tiers"):
        config.pluginmanager.register(_RuntimeFixtureTiers(), "prefixgate-runtime-tiers")


def pytest_unconfigure(config):
    if os.environ.get(UNITS_FILE) and not os.environ.get("PYTEST_XDIST_WORKER"):
        import shutil

        shutil.rmtree(os.path.dirname(os.environ.pop(UNITS_FILE)), ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return unit_scheduling(config, log) if os.environ.get(UNITS_FILE) else None


def pytest_collection_finish(session):
    if "torch" in sys.modules:  # test modules that import it did so at collection
        _torch()


def pytest_runtest_setup(item):
    if _stopped_early and "stack" in item.fixturenames:  # workers.share gives each worker one stack unit
        pytest.fail(f"{item.nodeid} ({unit_name(item)}) needs the stack, stopped after this worker's unit {_stopped_early[0]}")
    if "torch" in sys.modules and not _threads_set:  # or a test's own late import of it
        _torch()


# ---- models ---------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    """Randomly initialised, seeded models saved to disk (the engine loads from a directory)."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.engine import TINY_FAMILIES, tiny_config

    torch = _torch()
    dirs = {}
    for family in TINY_FAMILIES:
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(tiny_config(family))
        path = tmp_path_factory.mktemp(f"tiny-{family}")
        model.save_pretrained(path)
        dirs[family] = str(path)
    return dirs


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    from replica.default_model import default_model_dir as locate

    return str(locate())


@pytest.fixture(scope="session")
def hf_reference(default_model_dir):
    from transformers import AutoModelForCausalLM

    _torch()
    return AutoModelForCausalLM.from_pretrained(default_model_dir, attn_implementation="sdpa").eval()


# ---- real services --------------------------------------------------------------------------
@pytest.fixture(scope="session")
def redis_server():
    """A private redis-server on a free loopback port, for the whole test session."""
    from gateway.local_redis import LocalRedis

    server = LocalRedis().start()
    yield server
    server.cleanup()


@pytest.fixture(scope="session")
def stack(redis_server, tmp_path_factory):
    """The real stack: local Ray, Serve, 2 replicas of the default model, router, gateway; its
    routers record their decisions (the live audit) so a routing test can read what each saw."""
    import uuid

    from gateway.config import AppConfig
    from gateway.local_redis import free_port
    from gateway.stack import LocalStack

    config = AppConfig(
        redis_url=redis_server.url, key_prefix=f"test-{uuid.uuid4().hex[:6]}", replicas=2,
        kv_cache_mb=64, max_model_len=2048, default_max_tokens=32,
        kv_host_mb=128,  # a host K/V tier (2x the pool) below each pool: tests/test_kv_tiers.py, the tier metrics
        stall_timeout_s=10,  # tests/test_faults.py freezes a replica: wait 10 s for it, not 30
        # as every other live app of the suite: a loaded CI machine must not turn index lookups into
        # `stale` decisions (a stopped Redis still fails at once: connection refused)
        redis_timeout_s=1.0,
        audit_dir=str(tmp_path_factory.mktemp("audit")),  # tests/test_router_e2e.py reads the decisions
    )
    s = LocalStack(config, port=free_port(), metrics_port=free_port()).start()  # metrics: tests/test_metrics.py
    _STACKS.append(s)
    yield s
    s.stop()  # stopped already where the worker finished its stack unit (pytest_runtest_teardown)


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Under make test's workers, the stack serves one work unit (tests/helpers/workers.py): stop
    it after that unit's last test, not when the worker's other units are done too, so its idle
    Ray cluster does not take CPU and memory from them."""
    yield
    unit = unit_name(item)
    if _STACKS and unit is not None and unit.startswith(STACK_UNIT) and unit != unit_name(nextitem):
        _STACKS.pop().stop()
        _stopped_early.append(unit)


@pytest.fixture(scope="session")
def redis_cluster():
    """A real 3-master Redis Cluster on loopback ports, for the whole test session."""
    from gateway.local_redis_cluster import LocalRedisCluster

    cluster = LocalRedisCluster().start()
    yield cluster
    cluster.cleanup()


@pytest.fixture(params=["standalone", "cluster"])
def redis_url(request) -> str:
    """The index tests run against both: a standalone redis-server and a 3-master cluster."""
    server = request.getfixturevalue("redis_server" if request.param == "standalone" else "redis_cluster")
    return server.url
