"""Packed SFT through Megatron-LM's own machinery, 2 data-parallel ranks on CPU (gloo).

One uninterrupted run is the reference. A second run with the same training arguments (but
validation at every iteration, which must not disturb training and slows it enough to be
caught) is killed with SIGKILL right after its iteration-4 checkpoint and resumed with
``--load`` (without validation); its later steps must equal the reference's: the same examples,
LR and consumed count, and the same loss.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from megatron_lm_runs import launch, launch_and_kill, requires_megatron_lm, write_sft_yaml

pytestmark = [requires_megatron_lm, pytest.mark.slow]

B, DP, ITERS, WARMUP, LR, MIN_LR = 16, 2, 8, 2, 3e-3, 3e-4
V = math.floor(B * 0.2)


def _args(yaml: Path, save: Path, *extra: str) -> list[str]:
    return ["--packing-config", str(yaml), "--global-batch-size", str(B),
            "--train-iters", str(ITERS), "--save", str(save), "--save-interval", "4", *extra]


@pytest.fixture(scope="module")
def reference(sft_data, tmp_path_factory):
    """The uninterrupted run, with validation every 4 iterations and TensorBoard on."""
    tmp = tmp_path_factory.mktemp("reference")
    yaml = write_sft_yaml(tmp / "sft.yaml", sft_data)
    run = launch(DP, _args(yaml, tmp / "ckpt", "--eval-interval", "4", "--eval-iters", "2",
                           "--tensorboard-dir", str(tmp / "tb")), tmp / "log")
    assert run.returncode == 0, run.output[-4000:]
    run.tmp = tmp
    return run


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


def test_metrics_reach_megatron_tensorboard_writer(reference):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(reference.tmp / "tb"))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("train/actual_batch_size")}
    assert logged == {s["iteration"]: s["num_examples"] for s in reference.steps(0)}
    assert {"train/actual_num_tokens", "train/token_fill", "train/padding_bins",
            "train/loss", "valid/loss"} <= set(events.Tags()["scalars"])


def test_validation_runs_on_a_fixed_batch(reference):
    evaluations = reference.evaluations(0)
    assert [e["iteration"] for e in evaluations] == [4, 8]
    assert all(math.isfinite(e["valid_loss"]) for e in evaluations)


def test_kill_9_after_checkpoint_then_load_matches_uninterrupted(reference, sft_data, tmp_path):
    yaml = write_sft_yaml(tmp_path / "sft.yaml", sft_data)
    save = tmp_path / "ckpt"

    def after_checkpoint_4(log_dir: Path) -> bool:
        tracker = save / "latest_checkpointed_iteration.txt"
        return tracker.exists() and tracker.read_text().strip() == "4"

    killed = launch_and_kill(DP, _args(yaml, save, "--eval-interval", "1", "--eval-iters", "6"),
                             tmp_path / "log_killed", kill_when=after_checkpoint_4)
    assert killed.returncode == -9, killed.output[-3000:]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert max(s["iteration"] for s in killed.steps(0)) < ITERS, "the kill came too late"
    # Validation (every iteration here, every 4th in the reference) did not disturb training.
    for got, want in zip(killed.steps(0), reference.steps(0), strict=False):
        assert (got["examples"], got["loss"], got["lr"]) == (want["examples"], want["loss"],
                                                            want["lr"])

    resumed = launch(DP, _args(yaml, save, "--load", str(save)), tmp_path / "log_resumed")
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert "restored the packing loader state of iteration 4" in resumed.output
    for rank in range(DP):
        after = resumed.steps(rank)
        want = reference.steps(rank)[4:]
        assert [s["iteration"] for s in after] == list(range(5, ITERS + 1))
        for got, ref in zip(after, want, strict=True):
            assert got["examples"] == ref["examples"]
            assert got["consumed_train_samples"] == ref["consumed_train_samples"]
            assert got["lr"] == ref["lr"]
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)


def test_load_without_loader_state_is_refused(reference, sft_data, tmp_path):
    """A checkpoint whose loader state is missing must not restart the data silently."""
    import shutil

    yaml = write_sft_yaml(tmp_path / "sft.yaml", sft_data)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference.tmp / "ckpt", ckpt)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")
    for state in ckpt.glob("iter_0000004/*/train_dataloader_dprank*.pt"):
        state.unlink()
    run = launch(DP, _args(yaml, tmp_path / "unused", "--load", str(ckpt)), tmp_path / "log")
    assert run.returncode != 0
    assert "has no loader state for data-parallel rank" in run.output
