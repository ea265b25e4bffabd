"""How `make test` shares the suite between pytest-xdist workers (`-n 2 --dist loadscope
--no-loadscope-reorder`): run in one process the suite spends about a third of its time waiting
(Ray starting, replays paced in wall time, timers), which a second worker fills.

Each module is one work unit, so its module fixtures start once and its tests keep their
written order. The modules that use the session's Ray Serve stack (the `stack` fixture, about
70% of the suite's time) make one unit per worker, balanced by their recorded seconds: each
worker starts one stack and uses it for its share, in the written module order. Units go out
heaviest first, so the last to start are short and the workers finish together.

Only the workers collect, so they hand the units to the controller's scheduler (UnitScheduling)
in a file named by $PREFIXGATE_TEST_UNITS, set before the workers start. (xdist's own
`--dist loadgroup` would carry them in the test ids, which pytest 9 no longer lets it change.)

The seconds per module are recorded in tests/helpers/module_seconds.json from a serial run's
`--durations=0` report (`python -m tests.helpers.workers REPORT`); a module not in it is priced
by its tier. A stale record only costs balance, never a result.
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

STACK_UNIT = "serve-stack"
RECORD = Path(__file__).with_name("module_seconds.json")
UNITS_FILE = "PREFIXGATE_TEST_UNITS"  # the environment variable naming the units' file
UNIT = pytest.StashKey[str]()

# seconds per test by tier, for a module the record does not have yet
TIER_COST_S = {"pure": 0.1, "engine": 1.0, "redis": 1.0, "serve": 10.0, "cluster": 20.0, "vllm": 30.0}


def recorded_seconds() -> dict[str, float]:
    return json.loads(RECORD.read_text()) if RECORD.exists() else {}


def module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def module_costs(items: list[pytest.Item], tier_of_item: Callable[[pytest.Item], str],
                 recorded: dict[str, float]) -> dict[str, float]:
    estimate: dict[str, float] = collections.defaultdict(float)
    for item in items:
        estimate[module_of(item)] += TIER_COST_S[tier_of_item(item)]
    return {module: recorded.get(module, guess) for module, guess in estimate.items()}


def balance(costs: dict[str, float], bins: int) -> list[list[str]]:
    """Modules into `bins` groups of near-equal cost: each, heaviest first, to the lightest group."""
    groups: list[list[str]] = [[] for _ in range(max(1, bins))]
    load = [0.0] * len(groups)
    for module in sorted(costs, key=lambda m: -costs[m]):
        lightest = load.index(min(load))
        groups[lightest].append(module)
        load[lightest] += costs[module]
    return [g for g in groups if g]


def share(items: list[pytest.Item], tier_of_item: Callable[[pytest.Item], str], workers: int,
          recorded: dict[str, float] | None = None) -> dict[str, str]:
    """Give each item its work unit and reorder `items` in place: units by cost, heaviest
    first; inside a unit, the collected order. Returns the unit of each module."""
    costs = module_costs(items, tier_of_item, recorded_seconds() if recorded is None else recorded)
    stack_modules = {module_of(item) for item in items if "stack" in item.fixturenames}
    unit_of = {module: module for module in costs}
    for i, group in enumerate(balance({m: costs[m] for m in stack_modules}, workers)):
        unit_of.update({module: f"{STACK_UNIT}-{i}" for module in group})
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        unit = item.stash[UNIT] = unit_of[module_of(item)]
        units.setdefault(unit, []).append(item)
    unit_cost = {unit: sum(costs[m] for m in {module_of(i) for i in members}) for unit, members in units.items()}
    items[:] = [i for unit in sorted(units, key=lambda u: -unit_cost[u]) for i in units[unit]]
    return unit_of


def unit_name(item: pytest.Item | None) -> str | None:
    """The work unit `share` gave an item (None outside make test's workers, or no item)."""
    return item.stash.get(UNIT, None) if item is not None else None


def hand_over(unit_of: dict[str, str]) -> None:
    """A worker's units for the controller (every worker collects the same, so writes the same)."""
    path = Path(os.environ[UNITS_FILE])
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(unit_of))
    tmp.replace(path)


def unit_scheduling(config, log):
    """The controller's scheduler: xdist's loadscope with our units for scopes."""
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        units: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.units is None:  # read once the workers have collected (schedule() runs then)
                self.units = json.loads(Path(os.environ[UNITS_FILE]).read_text())
            module = nodeid.split("::")[0]
            return self.units.get(module, module)

    return UnitScheduling(config, log)


def worker_count() -> int:
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


DURATION_LINE = re.compile(r"^([\d.]+)s (?:call|setup|teardown)\s+(tests/[^:\s]+)::")


def seconds_from_report(report: str) -> dict[str, float]:
    """Seconds per module from pytest's `--durations=0` lines (setup, call and teardown)."""
    total: dict[str, float] = collections.defaultdict(float)
    for line in report.splitlines():
        if m := DURATION_LINE.match(line):
            total[m.group(2)] += float(m.group(1))
    return {module: round(s, 1) for module, s in sorted(total.items())}


if __name__ == "__main__":  # python -m tests.helpers.workers REPORT: rewrite the record
    seconds = seconds_from_report(Path(sys.argv[1]).read_text())
    if not seconds:
        sys.exit(f"no --durations lines in {sys.argv[1]}")
    RECORD.write_text(json.dumps(seconds, indent=1) + "\n")
    print(f"{len(seconds)} modules, {sum(seconds.values()):.0f} s, written to {RECORD}")
