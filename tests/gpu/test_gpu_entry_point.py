"""The Megatron-LM entry point on one GPU, as a user runs it from the megatron-core 0.19 wheel.

``python -m torch.distributed.run --nproc-per-node=1 -m megatron_packing.megatron_lm``: Megatron's
own ``initialize_megatron`` (its compile step included: a ``make`` that always fails is first on
``PATH``, and must never run, since the wheel's prebuilt dataset helpers import), the library's
GPT provider, bf16, torch_dist checkpoints. Four launches:

* packed, 20 iterations, saving at 10 and 20: finite, falling loss; the step accounting holds;
* the same run killed with SIGKILL once its iteration-10 checkpoint is complete, then resumed
  with ``--load``: iterations 11-20 equal the uninterrupted run's (examples, LR and consumed
  samples exactly; losses within a bf16 tolerance);
* padded mode (``use_sequence_packing: false``) under a token budget.
"""

from __future__ import annotations

import json
import math
import re
import signal
import statistics

import pytest
from gpu_runs import (
    TIER,
    ended,
    failing_make,
    launch,
    requires_wheel_training,
    runs,
    write_chats,
)

pytestmark = [*TIER, requires_wheel_training]

B, ITERS, SAVE_AT = 64, 20, 10
VARIATION = runs.PACKED_KEYS["packing_batch_size_allowed_variation"]
# Loss of a resumed step against the uninterrupted one: the same weights, optimizer state and
# examples, but CUDA kernels whose accumulation order may differ run to run, in bf16.
BF16_REL = 1e-2
PADDED_B, PADDED_ITERS, BUDGET = 32, 6, 8192


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    """1,400 training and 16 validation chats; the length index is built by the first launch and
    read by the others (one cache folder)."""
    return write_chats(tmp_path_factory.mktemp("gpu_chats"), train=1400, valid=16)


def packed_args(yaml, save) -> list[str]:
    return ["--packing-config", str(yaml), "--global-batch-size", str(B),
            "--train-iters", str(ITERS), "--save", str(save), "--save-interval", str(SAVE_AT),
            "--ckpt-format", "torch_dist"]


@pytest.fixture(scope="module")
def packed(chats, tmp_path_factory):
    """The uninterrupted packed run."""
    tmp = tmp_path_factory.mktemp("packed")
    env, calls = failing_make(tmp / "bin")
    yaml = runs.write_sft_yaml(tmp / "sft.yaml", chats)
    run = launch(packed_args(yaml, tmp / "ckpt"), tmp / "log", env=env)
    run.yaml, run.make_calls = yaml, calls
    return run


def started_from_the_wheel(run) -> None:
    """Megatron's compile step ran without make; the library's provider built a bf16 model."""
    assert not run.make_calls.exists(), "make ran: " + run.make_calls.read_text()
    assert "megatron-core's dataset helpers import" in run.output
    assert "GPT model from megatron_packing's provider" in run.output
    assert re.search(r"^\s*params_dtype \.+ torch\.bfloat16\s*$", run.output, re.MULTILINE)


def test_packed_training_from_the_wheel_runs_20_bf16_steps_with_a_falling_loss(packed):
    assert packed.returncode == 0, ended(packed)
    started_from_the_wheel(packed)
    steps = packed.steps()
    assert [s["iteration"] for s in steps] == list(range(1, ITERS + 1))
    losses = [s["loss"] for s in steps]
    assert all(math.isfinite(loss) for loss in losses), losses
    first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
    assert last < 0.98 * first, f"loss did not fall: first 5 {first:.4f}, last 5 {last:.4f}"
    consumed, seen = 0, []
    for step in steps:
        examples = [e for row in step["examples"] for e in row]
        assert len(examples) == step["num_examples"]
        assert step["micro_batches"] == len(step["examples"]) == step["num_bins"]
        assert abs(step["num_examples"] - B) <= math.floor(B * VARIATION)
        consumed += step["num_examples"]
        assert step["consumed_train_samples"] == consumed
        seen += examples
    assert len(seen) == len(set(seen)) == ITERS * B  # the drift is repaid by the last step
    step_ms = statistics.median(s["step_ms"] for s in steps[2:])
    print(f"loss {first:.3f} -> {last:.3f} (means of the first and last 5 steps); median step "
          f"{step_ms:.0f} ms")


def test_a_run_killed_after_its_checkpoint_resumes_as_the_uninterrupted_run(packed, tmp_path):
    assert packed.returncode == 0, ended(packed)
    env, calls = failing_make(tmp_path / "bin")
    save = tmp_path / "ckpt"
    killed = launch(packed_args(packed.yaml, save), tmp_path / "killed", env=env,
                    kill_when=runs.tracker_says(save, SAVE_AT))
    assert killed.returncode == -signal.SIGKILL, ended(killed)
    metadata = json.loads((save / f"iter_{SAVE_AT:07d}" / "metadata.json").read_text())
    assert metadata["sharded_backend"] == "torch_dist"
    before = killed.steps()
    assert len(before) >= SAVE_AT
    runs.same_steps(before[:SAVE_AT], packed.steps()[:SAVE_AT], rel=BF16_REL)

    resumed = launch([*packed_args(packed.yaml, save), "--load", str(save)],
                     tmp_path / "resumed", env=env)
    assert resumed.returncode == 0, ended(resumed)
    assert f"restored the packing loader state of iteration {SAVE_AT}" in resumed.output
    assert [s["iteration"] for s in resumed.steps()] == list(range(SAVE_AT + 1, ITERS + 1))
    runs.same_steps(resumed.steps(), packed.steps()[SAVE_AT:], rel=BF16_REL)
    assert not calls.exists()


def test_padded_mode_with_a_token_budget_trains_through_the_entry_point(chats, tmp_path):
    env, calls = failing_make(tmp_path / "bin")
    yaml = runs.write_sft_yaml(tmp_path / "sft.yaml", chats, padded=True,
                               max_tokens_per_microbatch=BUDGET)
    run = launch(["--packing-config", str(yaml), "--global-batch-size", str(PADDED_B),
                  "--train-iters", str(PADDED_ITERS)], tmp_path / "log", env=env)
    assert run.returncode == 0, ended(run)
    run.make_calls = calls
    started_from_the_wheel(run)
    steps = run.steps()
    assert [s["iteration"] for s in steps] == list(range(1, PADDED_ITERS + 1))
    seen = []
    for step in steps:
        assert step["max_tokens"] == BUDGET
        assert step["num_examples"] == PADDED_B
        assert step["micro_batches"] == len(step["examples"]) == len(step["block_rows"])
        assert math.isfinite(step["loss"])
        for rows, length, examples in zip(step["block_rows"], step["row_lengths"],
                                          step["examples"], strict=True):
            assert rows == len(examples)
            assert rows * length <= BUDGET or rows == 1, (rows, length)
        seen += [e for block in step["examples"] for e in block]
    assert len(seen) == len(set(seen)) == PADDED_ITERS * PADDED_B
    assert max(rows for step in steps for rows in step["block_rows"]) > 1, \
        "the budget must put several examples in a block"
