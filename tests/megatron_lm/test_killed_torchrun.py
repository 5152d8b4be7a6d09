"""A killed torchrun leaves nothing behind: each rank of the Megatron-LM entry point ends, with
what it started (the ``torch_dist`` writer's manager process and resource tracker, loader
workers), when torchrun's agent is killed with SIGKILL. Before, the ranks trained on, parented
to init, until their last iteration (`megatron_packing.common.process_lifetime`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from megatron_lm_runs import (
    DP,
    _env,
    rank_processes,
    reference_args,
    requires_megatron_lm,
    torchrun_command,
    tracker_says,
    write_sft_yaml,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from faults.process_checks import (  # noqa: E402
    kill_sessions,
    left_after,
    session_processes,
    sessions_below,
    wait_until,
)

pytestmark = [requires_megatron_lm, pytest.mark.slow, pytest.mark.one_stack(
    "what ends the ranks is torchrun's agent and the library's watch")]


def test_a_killed_torchrun_takes_its_ranks_and_all_they_started(sft_data, tmp_path):
    yaml = write_sft_yaml(tmp_path / "sft.yaml", sft_data)
    save, log = tmp_path / "ckpt", tmp_path / "run.log"
    args = [*reference_args(yaml, save, "--packing-num-workers", "2"), "--train-iters", "400",
            "--packing-log-dir", str(tmp_path / "steps")]
    agent = subprocess.Popen(torchrun_command(DP, args), env=_env(), stdout=log.open("w"),
                             stderr=subprocess.STDOUT, start_new_session=True)
    sessions = {agent.pid}  # torchrun's, and each worker's own
    try:
        wait_until(lambda: tracker_says(save, 4)(log), agent, log, what="a checkpoint saved")
        sessions |= sessions_below(agent.pid)
        parents = {pid: parent for pid, parent, _ in session_processes(sessions)}
        ranks = [pid for pid in rank_processes(agent.pid) if parents.get(pid) == agent.pid]
        assert len(ranks) == DP, ranks
        assert [pid for pid, parent in parents.items() if parent in ranks], \
            "the ranks have no children of their own: the kill would test nothing"
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        left = left_after(sessions)
        assert left == [], "\n".join(f"{pid} (parent {parent}): {cmd[:160]}"
                                     for pid, parent, cmd in left)
    finally:
        agent.kill()
        agent.wait()
        kill_sessions(sessions)
