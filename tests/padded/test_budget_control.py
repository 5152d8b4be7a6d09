"""The token-budget control file and the ``megatron-packing budget`` command: bad requests are
refused with a message and the job keeps its budget; a resumed controller does not apply the
same file twice."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from megatron_packing.cli import main as cli
from megatron_packing.padded.control_file import BUDGET_FILE, read_budget_file, write_budget_file
from megatron_packing.padded.sampler import TokenBudgetBatchSampler
from megatron_packing.padded.sync import TokenBudgetController
from megatron_packing.stream.base_order import SeededRandomOrder


def _sampler() -> TokenBudgetBatchSampler:
    lengths = np.random.default_rng(0).integers(16, 512, size=400)
    return TokenBudgetBatchSampler(SeededRandomOrder(len(lengths), seed=3), lengths, 16, 2,
                                   dp_rank=0, max_tokens_per_microbatch=2048)


def _controller(path, sampler, said):
    return TokenBudgetController(2048, control_file=path, check_every=1, target=sampler,
                                 report=said.append)


def _write(path, text: str, version: int) -> None:
    path.write_text(text)
    os.utime(path, ns=(version, version))


def _plan(sampler, controller, steps: int) -> list[int | None]:
    plans = iter(sampler)
    budgets = []
    for step in range(steps):
        controller.step_boundary(step)
        budgets.append(next(plans).max_tokens)
    return budgets


def test_a_change_lands_at_its_step_and_is_reported(tmp_path):
    path, sampler, said = tmp_path / BUDGET_FILE, _sampler(), []
    write_budget_file(path, 1024, from_step=3)
    assert json.loads(path.read_text()) == {"max_tokens_per_microbatch": 1024, "from_step": 3}
    assert _plan(sampler, _controller(path, sampler, said), 5) == [2048] * 3 + [1024] * 2
    assert said == ["token budget 1024 from step 3 (was 2048)"]


@pytest.mark.parametrize(("text", "complaint"), [
    ("max_tokens_per_microbatch: [1\n", "not valid JSON or YAML"),
    ('{"max_tokens_per_microbatch": 0}', "max_tokens_per_microbatch"),
    ('{"max_tokens": 4096}', "expected a mapping like"),
    ('{"max_tokens_per_microbatch": 4096, "from": 3}', "unknown keys ['from']"),
])
def test_a_bad_control_file_is_refused_once_and_the_budget_stays(tmp_path, text, complaint):
    path, sampler, said = tmp_path / BUDGET_FILE, _sampler(), []
    _write(path, text, 10**18)
    assert _plan(sampler, _controller(path, sampler, said), 4) == [2048] * 4
    assert len(said) == 1, said
    assert complaint in said[0] and str(path) in said[0]
    assert said[0].endswith("the token budget stays 2048")


def test_a_from_step_already_planned_is_refused_and_the_budget_stays(tmp_path):
    path, sampler, said = tmp_path / BUDGET_FILE, _sampler(), []
    controller = _controller(path, sampler, said)
    plans = iter(sampler)
    budgets = []
    for step in range(6):
        if step == 4:
            write_budget_file(path, 512, from_step=2)
        controller.step_boundary(step)
        budgets.append(next(plans).max_tokens)
    assert budgets == [2048] * 6
    assert said == ["refused the budget change to 512 from step 2: steps up to 3 are already "
                    "planned; the token budget stays 2048 (ask for step 4 or later)"]


def test_a_resumed_controller_does_not_apply_the_same_file_twice(tmp_path):
    path, sampler, said = tmp_path / BUDGET_FILE, _sampler(), []
    write_budget_file(path, 1024)  # from the first step not yet planned
    controller = _controller(path, sampler, said)
    assert _plan(sampler, controller, 3) == [1024] * 3
    state, loader_state = controller.state_dict(), sampler.state_dict()
    again, resumed_said = _sampler(), []
    again.load_state_dict(loader_state)
    resumed = _controller(path, again, resumed_said)
    resumed.load_state_dict(state)
    plans = iter(again)
    for step in range(3, 6):
        resumed.step_boundary(step)
        assert next(plans).max_tokens == 1024
    assert resumed_said == [], "the file's request was applied a second time"
    assert resumed.changes == controller.changes


def test_the_command_writes_the_file_and_refuses_bad_values(tmp_path, capsys):
    assert cli(["budget", "--run-dir", str(tmp_path), "16384", "--from-step", "1200"]) == 0
    request = read_budget_file(tmp_path / BUDGET_FILE)
    assert request is not None and (request.max_tokens, request.from_step) == (16384, 1200)
    assert not [p for p in tmp_path.iterdir() if p.name != BUDGET_FILE], "a temporary file stayed"
    for argv, message in [
        (["--run-dir", str(tmp_path / "missing"), "8"], "is not a directory"),
        (["--run-dir", str(tmp_path), "0"], "max_tokens_per_microbatch 0: give a token count"),
        (["--run-dir", str(tmp_path), "8", "--from-step", "-1"], "--from-step -1: give a step"),
    ]:
        assert cli(["budget", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("megatron-packing budget: error: ") and message in err
        assert "Traceback" not in err
    assert read_budget_file(tmp_path / BUDGET_FILE).max_tokens == 16384  # untouched
