"""Test tiers: ``slow`` (multi-process runs, training, subprocess launches) and ``fast`` (the rest).

Every test not marked ``slow`` is marked ``fast``, so ``pytest -m fast`` runs the quick tier
(unit, property and contract tests, in-process) and the README's command runs both.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.fast)
