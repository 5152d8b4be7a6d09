"""The tiers of the README's test command: the second stack deselects the ``one_stack`` launches
and counts them; a ``one_stack`` mark without its reason is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[2]


def _collect(*paths: str, second_stack: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "MEGATRON_PACKING_SECOND_STACK": "1" if second_stack else "0"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--collect-only", *paths], cwd=PROJECT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_second_stack_deselects_the_one_stack_launches_and_counts_them():
    path = "tests/megatron_lm/test_padded_mode.py"
    main = _collect(path, second_stack=False)
    second = _collect(path, second_stack=True)
    assert main.returncode == 0, main.stdout + main.stderr
    assert second.returncode == 0, second.stdout + second.stderr
    gone = {line for line in main.stdout.splitlines() if "::" in line} - \
        {line for line in second.stdout.splitlines() if "::" in line}
    assert sorted(name.split("::")[1] for name in gone) == [
        "test_a_resume_on_one_rank_plans_the_rest_at_that_size",
        "test_a_resumed_run_keeps_the_budget_change"]
    assert "2 deselected" in second.stdout


def test_a_one_stack_mark_without_a_reason_is_refused(tmp_path):
    (tmp_path / "conftest.py").write_text((PROJECT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_x.py").write_text(
        "import pytest\n\n@pytest.mark.one_stack\ndef test_x():\n    pass\n")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "--collect-only", str(tmp_path)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "one_stack needs the reason it runs once" in result.stdout + result.stderr
