"""Packed SFT through Megatron-LM's own machinery, 2 data-parallel ranks on CPU (gloo).

One uninterrupted run is the reference. A second run with the same training arguments (but
validation at every iteration, which must not disturb training and slows it enough to be
caught) is killed with SIGKILL right after its iteration-4 checkpoint and resumed with
``--load`` (without validation); its later steps must equal the reference's: the same examples,
LR and consumed count, and the same loss.
"""

from __future__ import annotations

import math

import pytest
from megatron_lm_runs import (
    DP,
    ITERS,
    B,
    launch,
    launch_and_kill,
    reference_args,
    requires_megatron_lm,
    same_steps,
    tracker_says,
    write_sft_yaml,
)

pytestmark = [requires_megatron_lm, pytest.mark.slow]

WARMUP, LR, MIN_LR = 2, 3e-3, 3e-4
V = math.floor(B * 0.2)


def _megatron_lr(consumed: int) -> float:
    """Megatron's linear warmup + cosine decay, sized in examples: iters x --global-batch-size."""
    warmup, decay = WARMUP * B, ITERS * B
    if consumed <= warmup:
        return LR * consumed / warmup
    ratio = (consumed - warmup) / (decay - warmup)
    return MIN_LR + (LR - MIN_LR) * 0.5 * (math.cos(math.pi * ratio) + 1)


def test_batch_size_varies_and_every_rank_runs_the_same_count(reference):
    steps = {rank: reference.steps(rank) for rank in range(DP)}
    assert [s["iteration"] for s in steps[0]] == list(range(1, ITERS + 1))
    counts = [s["micro_batches"] for s in steps[0]]
    assert len(set(counts)) > 1, "the micro-batch count must vary for this run to test anything"
    assert counts == [s["micro_batches"] for s in steps[1]]
    for s in steps[0]:
        assert s["num_bins"] == DP * s["micro_batches"]
        assert abs(s["num_examples"] - B) <= V


def test_each_example_trained_once_and_sizes_add_up(reference):
    seen: list[int] = []
    for i in range(ITERS):
        rows = [row for rank in range(DP) for row in reference.steps(rank)[i]["examples"]]
        indices = [e for row in rows for e in row]
        assert len(indices) == reference.steps(0)[i]["num_examples"]
        seen += indices
    assert len(seen) == len(set(seen)) == ITERS * B


def test_consumed_samples_count_real_examples_and_drift_is_repaid(reference):
    steps = reference.steps(0)
    running = 0
    for s in steps:
        running += s["num_examples"]
        assert s["consumed_train_samples"] == running
    assert running == ITERS * B
    assert any(abs(sum(x["num_examples"] for x in steps[:k]) - k * B) > 0
               for k in range(1, ITERS)), "no drift before the final step: nothing was repaid"
    assert f"training done at iteration {ITERS}: {ITERS * B} examples" in reference.output


def test_lr_schedule_advances_by_real_examples(reference):
    consumed = 0
    for s in reference.steps(0):
        assert s["lr"] == pytest.approx(_megatron_lr(consumed), rel=1e-9, abs=1e-12)
        consumed += s["num_examples"]
    assert consumed == ITERS * B and _megatron_lr(consumed) == pytest.approx(MIN_LR)


def test_megatron_metric_names_reach_the_tensorboard_writer(reference):
    """Megatron's own training_log writes its names with this step's counts; the packing
    metrics go to the same writer."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(reference.tmp / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    logged = {e.step: e.value for e in events.Scalars("train/actual_batch_size")}
    assert logged == {s["iteration"]: s["num_examples"] for s in reference.steps(0)}
    assert {"train/actual_num_tokens", "train/token_fill", "train/padding_bins",
            "train/loss"} <= tags
    assert {"lm loss", "learning-rate", "batch-size", "grad-norm", "params-norm", "num-zeros",
            "loss-scale", "world-size", "iteration-time", "throughput", "lm loss validation",
            "lm loss validation ppl", "forward-backward-time", "optimizer-time"} <= tags
    rows = {e.step: e.value for e in events.Scalars("batch-size")}  # Megatron counts rows
    assert rows == {s["iteration"]: s["num_bins"] for s in reference.steps(0)}
    # Megatron logs the LR after the scheduler's step: the LR the next iteration trains with.
    lr = {e.step: e.value for e in events.Scalars("learning-rate")}
    steps = reference.steps(0)
    assert lr == {s["iteration"]: pytest.approx(n["lr"], rel=1e-6)
                  for s, n in zip(steps, steps[1:], strict=False)} | {ITERS: pytest.approx(MIN_LR)}
    loss = {e.step: e.value for e in events.Scalars("lm loss")}
    assert loss == {s["iteration"]: pytest.approx(s["loss"], rel=1e-5)
                    for s in reference.steps(DP - 1)}
    assert "throughput per GPU (TFLOP/s/GPU)" in reference.output
    assert "Weight hashes match after 4 iterations" in reference.output


def test_validation_runs_on_the_validation_loader_and_after_training(reference):
    evaluations = reference.evaluations(0)
    assert [e["iteration"] for e in evaluations] == [4, 8]
    assert all(math.isfinite(e["valid_loss"]) for e in evaluations)
    final = "validation loss at iteration 8 on validation set | lm loss value: "
    assert final in reference.output
    value = float(reference.output.split(final)[1].split()[0])
    assert value == pytest.approx(evaluations[-1]["valid_loss"], rel=1e-6)
    # --skip-train: test_load_without_loader_state_is_refused_unless_finetune evaluates the
    # iteration-4 weights alone and finds the reference's iteration-4 validation loss.


def test_manual_gc_turns_automatic_collection_off(reference, killed_and_resumed):
    assert all(not s["gc_enabled"] for s in reference.steps(0))
    assert all(s["gc_enabled"] for s in killed_and_resumed.steps(0))


# Persistent torch_dist checkpoints every 2 iterations, global non-persistent ones every 3.
NON_PERSISTENT = ["--save-interval", "2", "--non-persistent-save-interval", "3",
                  "--non-persistent-ckpt-type", "global"]


@pytest.fixture(scope="module")
def killed_and_resumed(reference, sft_data, tmp_path_factory):
    """Killed with SIGKILL right after its iteration-3 non-persistent checkpoint (the newest:
    the persistent one is at 2), then ``--load``, which takes the newer of the two."""
    tmp = tmp_path_factory.mktemp("killed")
    yaml = write_sft_yaml(tmp / "sft.yaml", sft_data)
    save = tmp / "ckpt"
    killed = launch_and_kill(DP, reference_args(yaml, save, "--eval-interval", "1", "--eval-iters",
                                                "4", *NON_PERSISTENT),
                             tmp / "log_killed", kill_when=tracker_says(save / "non_persistent", 3))
    assert killed.returncode == -9, killed.output[-3000:]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    # Validation (every iteration here, every 4th in the reference) did not disturb training.
    for got, want in zip(killed.steps(0), reference.steps(0), strict=False):
        assert (got["examples"], got["loss"], got["lr"]) == (want["examples"], want["loss"],
                                                            want["lr"])
    resumed = launch(DP, reference_args(yaml, save, "--load", str(save), *NON_PERSISTENT),
                     tmp / "log_resumed")
    assert resumed.returncode == 0, resumed.output[-4000:]
    return resumed


def test_kill_9_after_checkpoint_then_load_matches_uninterrupted(reference, killed_and_resumed):
    assert "restored the packing loader state of iteration 3" in killed_and_resumed.output
    assert "in torch_dist format" in killed_and_resumed.output
    for rank in range(DP):
        same_steps(killed_and_resumed.steps(rank), reference.steps(rank)[3:])


@pytest.mark.one_stack("the refusal is the library's, before Megatron loads")
def test_load_without_loader_state_is_refused_unless_finetune(reference, sft_data, tmp_path):
    """A checkpoint whose loader state is missing must not restart the data silently; with
    --finetune the weights load and the data starts from the beginning on purpose."""
    import shutil

    yaml = write_sft_yaml(tmp_path / "sft.yaml", sft_data)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference.tmp / "ckpt", ckpt)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")
    for state in ckpt.glob("iter_0000004/*/train_dataloader_dprank*.pt"):
        state.unlink()
    run = launch(DP, reference_args(yaml, tmp_path / "unused", "--load", str(ckpt)), tmp_path / "log")
    assert run.returncode != 0
    assert "has no loader state for data-parallel rank" in run.output
    assert "building GPT model" not in run.output, "refused only after building the model"
    # --finetune takes the weights alone; with --skip-train the run only evaluates them: the
    # validation loss of the reference's own evaluation at iteration 4 (the same weights).
    tuned = launch(DP, reference_args(yaml, tmp_path / "tuned", "--load", str(ckpt), "--finetune",
                                      "--skip-train", "--eval-iters", "2"), tmp_path / "log_tuned")
    assert tuned.returncode == 0, tuned.output[-3000:]
    assert "skipping training (--skip-train is on)" in tuned.output
    assert not tuned.steps(0)
    final = "validation loss at iteration 0 on validation set | lm loss value: "  # --finetune
    value = float(tuned.output.split(final)[1].split()[0])
    at_4 = [e["valid_loss"] for e in reference.evaluations(0) if e["iteration"] == 4]
    assert value == pytest.approx(at_4[0], rel=1e-6), "the iteration-4 weights were not loaded"


@pytest.mark.one_stack("the refusal is the library's, before Megatron loads")
def test_another_global_batch_size_on_load_is_refused_by_name(reference, tmp_path):
    run = launch(DP, ["--packing-config", str(reference.tmp / "sft.yaml"), "--global-batch-size",
                      "32", "--train-iters", str(ITERS), "--load", str(reference.tmp / "ckpt")],
                 tmp_path / "log", timeout=120)
    assert run.returncode != 0
    assert (f"--global-batch-size 32: the checkpoint at iteration {ITERS} under "
            f"{reference.tmp / 'ckpt'} was trained with --global-batch-size {B}") in run.output
    assert "--override-opt_param-scheduler" in run.output
    assert "checkpoint value" not in run.output, "Megatron's scheduler check came first"
    assert "building GPT model" not in run.output
