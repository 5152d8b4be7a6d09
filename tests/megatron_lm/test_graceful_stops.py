"""Megatron-LM's graceful stops through the entry point, under torchrun, with real signals and
limits: each saves a checkpoint (loader state included) at a step boundary and exits 0, and
``--load`` then continues exactly as the uninterrupted reference run."""

from __future__ import annotations

import signal

import pytest
from megatron_lm_runs import (
    DP,
    ITERS,
    launch,
    launch_and_signal,
    logged_iterations,
    reference_args,
    requires_megatron_lm,
    same_steps,
    write_sft_yaml,
)

pytestmark = [requires_megatron_lm, pytest.mark.slow]


def _saved(save) -> int:
    return int((save / "latest_checkpointed_iteration.txt").read_text().strip())


def _resume_matches(reference, yaml, save, log_dir, saved: int) -> None:
    resumed = launch(DP, reference_args(yaml, save, "--load", str(save)), log_dir)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert f"restored the packing loader state of iteration {saved}" in resumed.output
    for rank in range(DP):
        same_steps(resumed.steps(rank), reference.steps(rank)[saved:])


def test_sigterm_to_every_rank_saves_at_the_next_step_and_resumes_exactly(reference, sft_data,
                                                                          tmp_path):
    yaml = write_sft_yaml(tmp_path / "sft.yaml", sft_data)
    save = tmp_path / "ckpt"
    stopped = launch_and_signal(DP, reference_args(yaml, save, "--exit-signal-handler"),
                                tmp_path / "log", signal_when=lambda d: logged_iterations(d) >= 2,
                                sig=signal.SIGTERM)
    assert stopped.returncode == 0, stopped.output[-4000:]
    assert "exiting program after receiving SIGTERM" in stopped.output
    saved = _saved(save)
    last = max(s["iteration"] for s in stopped.steps(0))
    assert saved == last and 2 <= saved < ITERS, (saved, last)
    same_steps(stopped.steps(0), reference.steps(0)[:saved])
    _resume_matches(reference, yaml, save, tmp_path / "log_resumed", saved)


def test_exit_interval_then_exit_duration_each_save_and_resume_exactly(reference, sft_data,
                                                                       tmp_path):
    yaml = write_sft_yaml(tmp_path / "sft.yaml", sft_data)
    save = tmp_path / "ckpt"
    first = launch(DP, reference_args(yaml, save, "--exit-interval", "3"), tmp_path / "log_1")
    assert first.returncode == 0, first.output[-4000:]
    assert "exiting program at iteration 3" in first.output
    assert _saved(save) == 3
    same_steps(first.steps(0), reference.steps(0)[:3])
    # The job's clock says it started an hour ago: --exit-duration-in-mins 1 stops it after its
    # first step, and that stop saves (no save interval falls there).
    second = launch(DP, [*reference_args(yaml, save, "--load", str(save)), "--save-interval",
                         "100", "--exit-duration-in-mins", "1"], tmp_path / "log_2",
                    env={"MEGATRON_PACKING_JOB_STARTED_S_AGO": "3600"})
    assert second.returncode == 0, second.output[-4000:]
    assert "exiting program after" in second.output and "minutes" in second.output
    assert _saved(save) == 4
    same_steps(second.steps(0), reference.steps(0)[3:4])
    _resume_matches(reference, yaml, save, tmp_path / "log_3", 4)
