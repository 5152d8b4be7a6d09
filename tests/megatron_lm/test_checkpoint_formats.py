"""Megatron's optimizer and checkpoint variants under the packing loop: the distributed
optimizer (overlapped grad reduce and param gather) trains as the reference run does, and a
torch_dist non-persistent checkpoint, killed with SIGKILL after its save, resumes exactly."""

from __future__ import annotations

import pytest
from megatron_lm_runs import (
    DP,
    launch,
    launch_and_kill,
    reference_args,
    requires_megatron_lm,
    same_steps,
    tracker_says,
    write_sft_yaml,
)

pytestmark = [requires_megatron_lm, pytest.mark.slow]

# Without checkpoints: megatron-core's torch-Adam fallback (no Apex or Transformer Engine, as
# here) cannot load the distributed optimizer's state back, which the entry point refuses at
# start-up (tests/megatron_lm/test_arguments.py). --async-save is not here either: Megatron runs
# it only with its persistent checkpoint worker, which pins itself to a CUDA device.
DISTRIBUTED = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]


def test_distributed_optimizer_trains_as_the_reference(reference, sft_data, tmp_path):
    """The distributed optimizer shards Adam's state and gathers the parameters: the same
    training as the reference's, to float rounding, with overlapped grad reduce and gather."""
    yaml = write_sft_yaml(tmp_path / "sft.yaml", sft_data)
    run = launch(DP, ["--packing-config", str(yaml), "--global-batch-size", "16",
                      "--train-iters", "8", *DISTRIBUTED], tmp_path / "log")
    assert run.returncode == 0, run.output[-4000:]
    for rank in range(DP):
        same_steps(run.steps(rank), reference.steps(rank), rel=1e-5)


def test_non_persistent_checkpoint_resumes_exactly(reference, sft_data, tmp_path):
    yaml = write_sft_yaml(tmp_path / "sft.yaml", sft_data)
    save = tmp_path / "ckpt"
    args = ["--non-persistent-save-interval", "3", "--non-persistent-ckpt-type", "global",
            "--save-interval", "100"]
    killed = launch_and_kill(DP, reference_args(yaml, save) + args, tmp_path / "log_1",
                             kill_when=tracker_says(save / "non_persistent", 3))
    assert killed.returncode == -9, killed.output[-3000:]
    assert not (save / "latest_checkpointed_iteration.txt").exists()
    resumed = launch(DP, reference_args(yaml, save, "--load", str(save)) + args,
                     tmp_path / "log_2")
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert "restored the packing loader state of iteration 3" in resumed.output
    for rank in range(DP):
        same_steps(resumed.steps(rank), reference.steps(rank)[3:])
