"""Megatron's loss checks and MoE through the entry point: a NaN loss stops the run through
megatron-core's rerun state machine, and a small MoE GPT trains with its aux loss."""

from __future__ import annotations

import math

import pytest
from megatron_lm_runs import launch, requires_megatron_lm, write_sft_yaml

pytestmark = [requires_megatron_lm, pytest.mark.slow]


def _run(sft_data, tmp_path, *extra: str):
    yaml = write_sft_yaml(tmp_path / "sft.yaml", sft_data)
    return launch(2, ["--packing-config", str(yaml), "--global-batch-size", "16",
                      "--train-iters", "6", *extra], tmp_path / "log")


def test_nan_loss_stops_the_run_through_the_rerun_state_machine(sft_data, tmp_path):
    """An absurd learning rate blows the weights up after the first step; the next forward
    loss is not finite and Megatron's check (on by default) stops the job on every rank."""
    run = _run(sft_data, tmp_path, "--lr", "1e30", "--min-lr", "1e29", "--lr-warmup-iters", "0")
    assert run.returncode != 0
    assert ("found NaN in local forward loss calculation" in run.output
            or "found Inf in local forward loss calculation" in run.output), run.output[-3000:]
    trained = run.steps(0)
    assert 1 <= len(trained) < 6
    assert all(math.isfinite(s["loss"]) for s in run.steps(1)), "a non-finite loss was logged"


def test_moe_trains_with_the_aux_loss_scaled_for_each_step(sft_data, tmp_path):
    tb = tmp_path / "tb"
    run = _run(sft_data, tmp_path, "--num-experts", "4", "--moe-router-topk", "2",
               "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
               "--disable-bias-linear", "--tensorboard-dir", str(tb))
    assert run.returncode == 0, run.output[-4000:]
    steps = run.steps(1)
    assert len({s["micro_batches"] for s in steps}) > 1, "the count must vary to test anything"
    assert all(math.isfinite(s["loss"]) for s in steps)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb))
    events.Reload()
    balancing = {e.step: e.value for e in events.Scalars("load_balancing_loss")}
    assert sorted(balancing) == [s["iteration"] for s in steps]
    # Megatron logs each step's MoE losses as the mean over its micro-batches (1 /
    # get_num_microbatches(), set to this step's count). Normalised by its coefficient, the
    # switch loss of one micro-batch is at least 1 (1 when balanced), and this tiny model stays
    # near 1: a sum would be >= the step's count (3 or more here), and a stale count from the
    # step before (3 against 4) would put a step at about 0.75 or 1.33.
    assert min(s["micro_batches"] for s in steps) >= 2
    for value in balancing.values():
        assert 0.999 <= value <= 1.15, balancing
