"""No process outlives the launcher, whatever is killed: the launcher, one rank, or the launcher's
whole process group, with and without loader workers, and during a save.

The mechanism alone (`megatron_packing.common.process_lifetime`) is tried on plain processes.
Each launch case starts the real ``megatron-packing train`` in a session of its own, lets it
reach a point where every rank has children of its own (the ``torch_dist`` checkpoint writer's
manager process after a save, loader workers, megatron-core's writer helpers during a save),
kills with SIGKILL, then lists the session: nothing may be left within a few seconds. Before
the fix, a rank's manager process and the ``multiprocessing`` resource tracker it kept open
were still there, parented to init.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from .process_checks import kill_a_training_run, kill_sessions, left_after, session_processes
from .run_faults_helpers import cli_env

LEADER = """
import os, subprocess, sys, time
from megatron_packing.common import process_lifetime
process_lifetime.lead_process_group()
process_lifetime.end_group_with_parent(os.getppid())
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(os.getpid(), child.pid, flush=True)
time.sleep(60)
"""


def test_a_group_leader_killed_with_its_parent_takes_its_children(tmp_path):
    """A process that leads its group ends, with what it started, the moment its parent is
    killed (a parent-death signal would end it alone: Linux clears it in every child)."""
    parent_code = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                   f"{LEADER!r}]); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE,
                              text=True, env=cli_env(), start_new_session=True)
    session = {parent.pid}
    try:
        assert parent.stdout is not None
        leader, child = (int(pid) for pid in parent.stdout.readline().split())
        assert {p for p, _, _ in session_processes(session)} == {parent.pid, leader, child}
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        assert left_after(session, timeout=5) == []
    finally:
        parent.kill()
        parent.wait()
        kill_sessions(session)


# (what is killed, loader workers, when): four launches in all.
CASES = [
    ("launcher", 2, "after a save"),
    ("one rank", 0, "after a save"),
    ("process group", 2, "after a save"),
    ("launcher", 0, "during a save"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("target", "workers", "when"), CASES,
                         ids=[f"{t}, {w} workers, {when}" for t, w, when in CASES])
def test_nothing_outlives_a_kill(tmp_path, target, workers, when):
    wandb = target == "launcher" and workers == 2  # W&B's service must go too
    killed = kill_a_training_run(tmp_path, target=target, workers=workers, when=when,
                                 wandb=wandb)
    assert killed.children_before > 0, "the ranks had started nothing: the kill tested nothing"
    assert killed.services_before == (1 if wandb else 0)
    assert killed.left == [] and killed.services_left == [], killed.describe()
    if target == "one rank":
        assert killed.returncode == 1
        assert "rank 1: the rank process died (killed by SIGKILL)" in killed.log
