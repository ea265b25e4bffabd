"""A pytest plugin: with `-p tests.helpers.tier_report`, write every collected test's tier record
(tests/helpers/tiers.py) as JSON to $PREFIXGATE_TIER_REPORT. tests/test_tiers.py runs it when its
own session did not collect the whole suite."""

from __future__ import annotations

import json
import os

from tests.helpers.tiers import COLLECTED


def pytest_collection_finish(session) -> None:
    path = os.environ.get("PREFIXGATE_TIER_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(session.config.stash.get(COLLECTED, {}), f)
