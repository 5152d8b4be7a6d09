"""Megatron's checkpoint formats and writers under the packing loop: torch_dist with the
distributed optimizer (overlapped grad reduce and param gather), and non-persistent checkpoints; each killed with
SIGKILL after a save and resumed with ``--load``, exactly (the reference run saves torch_dist
without them; tests/megatron_lm/test_real_loop.py)."""

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

# --async-save is not here: Megatron runs it only with its persistent checkpoint worker, which
# pins itself to a CUDA device.
DISTRIBUTED = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]


def test_distributed_optimizer_kill_9_then_load_is_exact(reference, sft_data,
                                                                    tmp_path):
    yaml = write_sft_yaml(tmp_path / "sft.yaml", sft_data)
    save = tmp_path / "ckpt"
    killed = launch_and_kill(DP, reference_args(yaml, save, *DISTRIBUTED), tmp_path / "log_1",
                             kill_when=tracker_says(save, 4))
    assert killed.returncode == -9, killed.output[-3000:]
    assert "in torch_dist format" in killed.output
    # The distributed optimizer shards Adam's state and gathers the parameters: the same
    # training as the reference's, to float rounding.
    same_steps(killed.steps(0), reference.steps(0)[:len(killed.steps(0))], rel=1e-5)
    resumed = launch(DP, reference_args(yaml, save, *DISTRIBUTED, "--load", str(save)),
                     tmp_path / "log_2")
    assert resumed.returncode == 0, resumed.output[-4000:]
    for rank in range(DP):
        same_steps(resumed.steps(rank), reference.steps(rank)[4:], rel=1e-5)


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
