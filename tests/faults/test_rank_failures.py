"""One clean failure per failure: an error on any rank reaches the launcher once, naming the
rank; refusals and faults are told apart; a bug keeps its traceback."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

from megatron_packing.common.validation import ConfigError
from megatron_packing.demo.launch import RankFailed, spawn_data_parallel

from . import rank_helpers
from .run_faults_helpers import run_cli, tiny_config, train_command, wait_gone, write_config

pytestmark = pytest.mark.slow


def test_a_refusal_on_one_rank_is_one_refusal_naming_it():
    with pytest.raises(RankFailed) as info:
        spawn_data_parallel(rank_helpers.refuse_on_rank_1, 2, refusals=(ConfigError,))
    failure = info.value
    assert failure.refusal and failure.rank == 1 and failure.detail == ""
    assert str(failure) == "rank 1: train.yaml: packing.seed must be an integer >= 0, got -1"


def test_an_unexpected_exception_is_a_bug_with_its_traceback():
    with pytest.raises(RankFailed) as info:
        spawn_data_parallel(rank_helpers.bug_on_rank_0, 2, refusals=(ConfigError,))
    failure = info.value
    assert not failure.refusal and failure.rank == 0
    assert str(failure) == "rank 0: KeyError: 'world_size'"
    assert "Traceback" in failure.detail and "bug_on_rank_0" in failure.detail


def test_a_killed_rank_is_a_fault_naming_the_signal():
    with pytest.raises(RankFailed, match=r"rank 1: the rank process died \(killed by SIGKILL\)"):
        spawn_data_parallel(rank_helpers.killed_on_rank_1, 2)


def test_a_killed_rank_takes_what_it_started_with_it(tmp_path):
    pid_file = tmp_path / "child.pid"
    with pytest.raises(RankFailed, match=r"rank 1: the rank process died \(killed by SIGKILL\)"):
        spawn_data_parallel(rank_helpers.killed_with_a_child_on_rank_1, 2, str(pid_file))
    child = int(pid_file.read_text())
    try:
        assert wait_gone([child], timeout=5) == [], "the killed rank's child outlived it"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def test_ranks_that_succeed_raise_nothing():
    spawn_data_parallel(rank_helpers.succeed, 2)


def test_a_refused_resume_inside_the_ranks_is_one_message_and_exit_code_2(tmp_path):
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path, steps=2,
                                                           train__checkpoint_every=1))
    out = tmp_path / "out"
    first = run_cli(train_command(config, out, "--no-wandb"), timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    doc = tiny_config(tmp_path, steps=4, train__checkpoint_every=1)
    doc["packing"]["global_batch_size"] = 16  # the sampler state's fingerprint differs
    changed = write_config(tmp_path / "b.yaml", doc)
    result = run_cli(train_command(changed, out, "--no-wandb", "--resume"), timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.count("cannot resume") == 1, result.stderr
    assert "error: rank 0: checkpoint" in result.stderr or "error: rank 1: checkpoint" in \
        result.stderr
    assert "batch_size: saved 8, now 16" in result.stderr
    for raw in ("Traceback", "ProcessRaisedException", "ProcessExitedException",
                "torch.multiprocessing"):
        assert raw not in result.stderr, result.stderr
    # a changed learning rate is refused before any rank starts, by name
    doc = tiny_config(tmp_path, steps=4, train__checkpoint_every=1)
    doc["train"]["lr"] = 0.02
    result = run_cli(train_command(write_config(tmp_path / "lr.yaml", doc), out, "--no-wandb",
                                   "--resume"), timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "train.lr: saved 0.01, now 0.02" in result.stderr
    assert "Traceback" not in result.stderr
