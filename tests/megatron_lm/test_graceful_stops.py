"""Megatron-LM's graceful stops through the entry point, under torchrun, with real signals and
limits: each saves a checkpoint (loader state included) at a step boundary and exits 0, and
``--load`` then continues exactly as the uninterrupted reference run. The three stops are one
chain of launches: each resumes from the checkpoint the previous stop wrote."""

from __future__ import annotations

import signal

import pytest
from megatron_lm_runs import (
    DP,
    FULL_EXIT,
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


@pytest.fixture(scope="module")
def stops(reference, sft_data, tmp_path_factory):
    """One run stopped three ways, each stop resumed by the next launch: SIGTERM to every rank
    (--exit-signal-handler), then --exit-interval, then --exit-duration-in-mins."""
    tmp = tmp_path_factory.mktemp("stops")
    yaml = write_sft_yaml(tmp / "sft.yaml", sft_data)
    save = tmp / "ckpt"
    runs = {}
    runs["sigterm"] = launch_and_signal(
        DP, reference_args(yaml, save, "--exit-signal-handler"), tmp / "log_sigterm",
        signal_when=lambda d: logged_iterations(d) >= 2, sig=signal.SIGTERM)
    runs["sigterm"].saved = _saved(save)
    assert runs["sigterm"].saved < ITERS - 2, "stopped too late to test the other stops"
    # --exit-interval N stops after the first iteration divisible by N (the next one here).
    interval = runs["sigterm"].saved + 1
    runs["interval"] = launch(DP, reference_args(yaml, save, "--load", str(save),
                                                 "--exit-interval", str(interval)),
                              tmp / "log_interval", env=FULL_EXIT)
    runs["interval"].saved = _saved(save)
    # The job's clock says it started an hour ago: --exit-duration-in-mins 1 stops it after its
    # first step, and that stop saves (no save interval falls there).
    runs["duration"] = launch(DP, [*reference_args(yaml, save, "--load", str(save)),
                                   "--save-interval", "100", "--exit-duration-in-mins", "1"],
                              tmp / "log_duration",
                              env={**FULL_EXIT, "MEGATRON_PACKING_JOB_STARTED_S_AGO": "3600"})
    runs["duration"].saved = _saved(save)
    return runs


def _stopped_and_resumed_exactly(run, reference, first: int) -> None:
    """Exit 0, a checkpoint at the last trained iteration, and the same steps as the
    uninterrupted run from iteration ``first + 1`` (after the previous stop's checkpoint)."""
    assert run.returncode == 0, run.output[-4000:]
    last = max(s["iteration"] for s in run.steps(0))
    assert run.saved == last, (run.saved, last)
    if first:
        assert f"restored the packing loader state of iteration {first}" in run.output
    for rank in range(DP):
        same_steps(run.steps(rank), reference.steps(rank)[first:last])


def test_sigterm_to_every_rank_saves_at_the_next_step_and_resumes_exactly(stops, reference):
    run = stops["sigterm"]
    assert "exiting program after receiving SIGTERM" in run.output
    assert run.saved >= 2
    _stopped_and_resumed_exactly(run, reference, 0)


def test_exit_interval_saves_and_resumes_exactly(stops, reference):
    run = stops["interval"]
    assert f"exiting program at iteration {run.saved}" in run.output
    assert run.saved == stops["sigterm"].saved + 1
    _stopped_and_resumed_exactly(run, reference, stops["sigterm"].saved)


def test_exit_duration_saves_and_resumes_exactly(stops, reference):
    run = stops["duration"]
    assert "exiting program after" in run.output and "minutes" in run.output
    assert run.saved == stops["interval"].saved + 1
    _stopped_and_resumed_exactly(run, reference, stops["interval"].saved)
