"""Registers the shared data fixture of the Megatron-LM tests (helpers live in megatron_lm_runs),
and puts the Megatron-LM checkout first on ``sys.path`` so that its real argument parser and
training loop can be read in this process too."""

import sys

import pytest
from megatron_lm_runs import (
    DP,
    LOGGING,
    MEGATRON_LM,
    SKIP_REASON,
    launch,
    reference_args,
    sft_data,  # noqa: F401
    write_sft_yaml,
)

if SKIP_REASON is None and MEGATRON_LM is not None and str(MEGATRON_LM) not in sys.path:
    sys.path.insert(0, str(MEGATRON_LM))


@pytest.fixture(scope="session")
def reference(sft_data, tmp_path_factory):  # noqa: F811
    """The uninterrupted run, with validation every 4 iterations and TensorBoard on."""
    tmp = tmp_path_factory.mktemp("reference")
    yaml = write_sft_yaml(tmp / "sft.yaml", sft_data)
    run = launch(DP, reference_args(yaml, tmp / "ckpt", "--eval-interval", "4", "--eval-iters", "2",
                           "--tensorboard-dir", str(tmp / "tb"), *LOGGING), tmp / "log")
    assert run.returncode == 0, run.output[-4000:]
    run.tmp = tmp
    return run
