"""Test tiers: ``slow`` (multi-process runs, training, subprocess launches) and ``fast`` (the rest).

Every test not marked ``slow`` is marked ``fast``, so ``pytest -m fast`` runs the quick tier
(unit, property and contract tests, in-process) and the README's command runs both.

``one_stack`` marks a launch whose subject does not depend on the megatron-core release (the
library's own refusals, plans and process handling, already run on the main stack); the second
stack (``scripts/test_stack312.sh`` sets ``MEGATRON_PACKING_SECOND_STACK=1``) deselects them, and
pytest's summary counts them as deselected.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

# No per-example deadline: speed is measured by the benchmarks, never asserted by a test, and the
# fast tier shares its 2 cores with a second pytest process and, in scripts/test.sh, an install.
settings.register_profile("megatron_packing", deadline=None)
settings.load_profile("megatron_packing")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "one_stack(reason): run on the main stack only; the reason says why the "
        "megatron-core release does not change what the test checks")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.fast)
        marker = item.get_closest_marker("one_stack")
        if marker is not None and not (marker.args or marker.kwargs.get("reason")):
            raise pytest.UsageError(f"{item.nodeid}: one_stack needs the reason it runs once")
    if os.environ.get("MEGATRON_PACKING_SECOND_STACK") == "1":
        kept = [item for item in items if item.get_closest_marker("one_stack") is None]
        deselected = [item for item in items if item.get_closest_marker("one_stack") is not None]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = kept
