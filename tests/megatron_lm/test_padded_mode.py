"""Padded mode (token-budget ``[b, L]`` micro-batches) through Megatron-LM's loop on CPU.

Four launches with the model in float64:

* the budgeted run: DP 2, a token budget under which the two ranks' counts differ (the shorter
  rank runs dummies), and an operator's ``megatron-packing budget`` while it runs;
* the unpacked reference: one process, one example per micro-batch, no padding at all. Every
  step's loss and gradient norm must agree with the budgeted run's to rel 1e-6 (megatron-core
  computes the cross entropy and the norm in float32), and the examples, the LR and Megatron's
  consumed-sample count exactly: the loss does not depend on how a step is cut;
* the budgeted run resumed from its iteration-3 checkpoint: it must equal the uninterrupted run
  bit for bit, the budget change included (whether the change was agreed before that
  checkpoint, and so is in its loader state, or after it, and so is read again from the file);
* TP 2: its rows must train the plan's loss tokens, and its loss equal the unpacked reference's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from megatron_lm_runs import (
    PROJECT,
    launch,
    launch_and_act,
    logged_iterations,
    requires_megatron_lm,
    write_sft_yaml,
)

pytestmark = [requires_megatron_lm, pytest.mark.slow]

B, ITERS, BUDGET, NEW_BUDGET, CHANGE_STEP = 16, 7, 1536, 1024, 5
# The demo chats run to 1,483 tokens: the model's positions must cover the longest one whole.
LONG_ROWS = ["--seq-length", "1536", "--max-position-embeddings", "1536"]
FLOAT64 = {"MEGATRON_PACKING_TEST_FLOAT64": "1"}


def _args(yaml: Path, *extra: str) -> list[str]:
    return ["--packing-config", str(yaml), "--global-batch-size", str(B), "--train-iters",
            str(ITERS), "--eval-iters", "1", "--eval-interval", "3", *LONG_ROWS, *extra]


def _budget_command(save: Path) -> None:
    """What an operator runs while the job trains."""
    done = subprocess.run([sys.executable, "-m", "megatron_packing.cli", "budget", "--run-dir",
                           str(save), str(NEW_BUDGET), "--from-step", str(CHANGE_STEP)],
                          capture_output=True, text=True, cwd=PROJECT, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def budgeted(sft_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("padded")
    yaml = write_sft_yaml(tmp / "sft.yaml", sft_data, padded=True, max_tokens_per_microbatch=BUDGET)
    save = tmp / "ckpt"
    save.mkdir()
    run = launch_and_act(2, _args(yaml, "--save", str(save), "--save-interval", "3"),
                         tmp / "log", act_when=lambda d: logged_iterations(d) >= 1,
                         action=lambda: _budget_command(save), env=FLOAT64)
    assert run.returncode == 0, run.output[-4000:]
    run.tmp, run.yaml, run.save = tmp, yaml, save
    return run


@pytest.fixture(scope="module")
def unpacked(sft_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("unpacked")
    yaml = write_sft_yaml(tmp / "sft.yaml", sft_data, padded=True, micro_batch_size=1)
    run = launch(1, _args(yaml), tmp / "log", env=FLOAT64)
    assert run.returncode == 0, run.output[-4000:]
    return run


def _trained(step: dict) -> list[int]:
    return sorted(e for block in step["examples"] for e in block)


def test_every_rank_runs_the_same_count_with_dummies_where_it_runs_short(budgeted):
    ranks = [budgeted.steps(rank) for rank in (0, 1)]
    assert [len(steps) for steps in ranks] == [ITERS, ITERS]
    dummies = 0
    for mine, theirs in zip(*ranks, strict=True):
        assert mine["micro_batches"] == theirs["micro_batches"] == len(mine["examples"])
        dummies += sum(block == [] for block in mine["examples"] + theirs["examples"])
    assert dummies > 0, "the budget must leave one rank short on some step"
    assert len({s["micro_batches"] for s in ranks[0]}) > 1, "the count must vary by step"
    blocks = {(b, L) for s in ranks[0] for b, L in zip(s["block_rows"], s["row_lengths"],
                                                       strict=True) if b}
    assert len({b for b, _ in blocks}) > 1 and len({L for _, L in blocks}) > 1
    for steps in ranks:  # each block holds at most the budget, unless one example exceeds it
        for s in steps:
            for b, L in zip(s["block_rows"], s["row_lengths"], strict=True):
                assert b * L <= s["max_tokens"] or b == 1


def test_each_example_trained_once_and_as_the_reference(budgeted, unpacked):
    seen = [e for rank in (0, 1) for s in budgeted.steps(rank) for e in _trained(s)]
    assert len(seen) == len(set(seen)) == ITERS * B
    for step, want in enumerate(unpacked.steps(0)):
        got = sorted(_trained(budgeted.steps(0)[step]) + _trained(budgeted.steps(1)[step]))
        assert got == _trained(want)
        assert budgeted.steps(0)[step]["num_examples"] == B


def test_padded_training_equals_unpacked_training_in_float64(budgeted, unpacked):
    for got, want in zip(budgeted.steps(0), unpacked.steps(0), strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6)
        assert got["lr"] == want["lr"]
        assert got["consumed_train_samples"] == want["consumed_train_samples"]
    assert [e["valid_loss"] for e in budgeted.evaluations(0)] == pytest.approx(
        [e["valid_loss"] for e in unpacked.evaluations(0)], rel=1e-6)


def test_a_budget_changed_while_the_job_runs_lands_at_one_step_on_every_rank(budgeted):
    for rank in (0, 1):
        budgets = [s["max_tokens"] for s in budgeted.steps(rank)]
        assert budgets == [BUDGET] * CHANGE_STEP + [NEW_BUDGET] * (ITERS - CHANGE_STEP)
    assert f"token budget {NEW_BUDGET} from step {CHANGE_STEP} (was {BUDGET})" in budgeted.output


@pytest.mark.one_stack("the budget file and its resume are the library's")
def test_a_resumed_run_keeps_the_budget_change(budgeted, tmp_path):
    resumed = launch(2, _args(budgeted.yaml, "--load", str(budgeted.save), "--ckpt-step", "3",
                              "--save", str(tmp_path / "ckpt"), "--save-interval", "100",
                              "--packing-budget-file",
                              str(budgeted.save / "token_budget.json")),
                     tmp_path / "log", env=FLOAT64)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert "restored the packing loader state of iteration 3" in resumed.output
    for rank in (0, 1):
        want = budgeted.steps(rank)[3:]
        got = resumed.steps(rank)
        assert [(s["iteration"], s["examples"], s["max_tokens"], s["lr"]) for s in got] == \
            [(s["iteration"], s["examples"], s["max_tokens"], s["lr"]) for s in want]
        assert [s["loss"] for s in got] == [s["loss"] for s in want]  # bit for bit


@pytest.mark.one_stack(
    "the plan at the new size is the library's; resharding on 0.19 is "
    "test_elastic_resume's")
def test_a_resume_on_one_rank_plans_the_rest_at_that_size(budgeted, tmp_path):
    """The DP-2 run's iteration-3 checkpoint continued at DP 1: each step trains the same global
    batch (the same loss, in float64), now as one rank's token-budget blocks; the budget change
    still lands at its step."""
    resumed = launch(1, _args(budgeted.yaml, "--load", str(budgeted.save), "--ckpt-step", "3",
                              "--save", str(tmp_path / "ckpt"), "--save-interval", "100",
                              "--packing-budget-file",
                              str(budgeted.save / "token_budget.json")),
                     tmp_path / "log", env=FLOAT64)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert "saved at data-parallel size 2, now 1" in resumed.output
    got = resumed.steps(0)
    want = list(zip(budgeted.steps(0)[3:], budgeted.steps(1)[3:], strict=True))
    assert [s["iteration"] for s in got] == list(range(4, ITERS + 1))
    for mine, (rank0, rank1) in zip(got, want, strict=True):
        assert _trained(mine) == sorted(_trained(rank0) + _trained(rank1))
        assert mine["max_tokens"] == rank0["max_tokens"]
        assert mine["lr"] == rank0["lr"]
        assert mine["consumed_train_samples"] == rank0["consumed_train_samples"]
        assert mine["loss"] == pytest.approx(rank0["loss"], rel=1e-6)
        for b, L in zip(mine["block_rows"], mine["row_lengths"], strict=True):
            assert b * L <= mine["max_tokens"] or b == 1


def test_tp2_trains_the_plans_loss_tokens_and_the_tp1_loss(sft_data, unpacked, tmp_path):
    """TP 2 (one DP rank): every step's rows train exactly the plan's loss tokens, and the loss
    equals the unpacked TP 1 run's. Three iterations: until the third the LR is the warm-up's,
    whatever --train-iters, so the steps compare with the reference's. (Blocks are widened to
    the TP size only under --sequence-parallel, which megatron-core's local layers cannot run
    without Apex, so not on CPU: tests/megatron_lm/test_step_rows.py pins the widening.)"""
    yaml = write_sft_yaml(tmp_path / "sft.yaml", sft_data, padded=True,
                          max_tokens_per_microbatch=BUDGET)
    iters = 3
    run = launch(2, ["--packing-config", str(yaml), "--global-batch-size", str(B),
                     "--train-iters", str(iters), "--eval-iters", "0", *LONG_ROWS,
                     "--tensor-model-parallel-size", "2"], tmp_path / "log", env=FLOAT64)
    assert run.returncode == 0, run.output[-4000:]
    steps = run.steps(0)
    assert [(s["examples"], s["row_lengths"]) for s in run.steps(1)] == \
        [(s["examples"], s["row_lengths"]) for s in steps]  # the TP ranks share the plan
    assert any(b > 1 for s in steps for b in s["block_rows"]), "no block padded two examples"
    for got, want in zip(steps, unpacked.steps(0)[:iters], strict=True):
        assert got["loss_tokens"] == got["plan_loss_tokens"] > 0
        assert _trained(got) == _trained(want)
        assert got["lr"] == want["lr"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
