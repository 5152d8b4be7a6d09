"""Megatron's optimizer variants under the packing loop: the distributed optimizer (overlapped
grad reduce and param gather) trains as the reference run does. (The non-persistent torch_dist
checkpoint is the one the kill -9 test of test_real_loop.py resumes from.)"""

from __future__ import annotations

import pytest
from megatron_lm_runs import (
    DP,
    launch,
    requires_megatron_lm,
    same_steps,
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
