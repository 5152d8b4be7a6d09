"""Every in-process case of the hostile catalogue ends correct or with a clear refusal: no
silent result, no raw traceback, no unclear message (the process cases: test_run_overwrite,
test_rank_failures, test_config_strictness, test_tune_faults)."""

from __future__ import annotations

import pytest

from .hostile_cases import CASES, classify

LIBRARY = [case for case in CASES if case.group == "library"]


@pytest.mark.parametrize("case", LIBRARY, ids=[case.name for case in LIBRARY])
def test_a_hostile_case_is_correct_or_clearly_refused(case, tmp_path):
    outcome, detail = classify(case, tmp_path)
    assert outcome in ("correct", "clear"), f"{outcome}: {detail}"
