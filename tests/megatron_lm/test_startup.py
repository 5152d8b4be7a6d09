"""Start-up through torchrun as a new user meets it: Megatron's compile step runs unshimmed.

The megatron-core wheels ship the compiled dataset helpers and no Makefile, so Megatron's own
start-up (``make`` on global rank 0, then a barrier) would end rank 0 and leave the others
waiting. These launches put a ``make`` that always fails first on ``PATH``.
"""

from __future__ import annotations

import os

import pytest
from megatron_lm_runs import FULL_EXIT, launch, requires_megatron_lm, write_sft_yaml

pytestmark = [requires_megatron_lm, pytest.mark.slow]


def _failing_make(tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "make").write_text(f"#!/bin/sh\necho \"$@\" >> {folder / 'calls'}\nexit 2\n")
    (folder / "make").chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}, folder / "calls"


def test_the_entry_point_trains_with_a_make_that_always_fails(sft_data, tmp_path):
    env, calls = _failing_make(tmp_path)
    yaml = write_sft_yaml(tmp_path / "sft.yaml", sft_data)
    run = launch(2, ["--packing-config", str(yaml), "--global-batch-size", "16",
                     "--train-iters", "3"], tmp_path / "log", env={**env, **FULL_EXIT},
                 timeout=240)
    assert run.returncode == 0, run.output[-4000:]
    assert "megatron-core's dataset helpers import" in run.output
    assert not calls.exists()  # make never ran
    assert [s["iteration"] for s in run.steps()] == [1, 2, 3]


def test_helpers_that_neither_import_nor_build_stop_every_rank_before_any_collective(
        sft_data, tmp_path):
    env, calls = _failing_make(tmp_path)
    yaml = write_sft_yaml(tmp_path / "sft.yaml", sft_data)
    run = launch(2, ["--packing-config", str(yaml), "--global-batch-size", "16",
                     "--train-iters", "3"], tmp_path / "log", timeout=150,
                 env={**env, **FULL_EXIT, "MEGATRON_PACKING_TEST_HIDE_HELPERS": "1"})
    assert run.returncode != 0
    for rank in (0, 1):
        assert run.output.count(f"megatron_packing.megatron_lm [rank {rank}]: error: "
                                "megatron-core's compiled dataset helpers") == 1
    assert "has no Makefile to build them with" in run.output
    assert "initializing torch distributed" not in run.output  # no rank reached a collective
    # No traceback from the ranks (torchrun prints its own summary of the failed ranks).
    assert "[rank0]: Traceback" not in run.output and "[rank1]: Traceback" not in run.output
    assert not calls.exists()
