"""A rank process and everything it starts end together, whatever is killed.

A rank starts processes it does not control: loader workers (forked), megatron-core's checkpoint
writer helpers (forked per save) and the ``multiprocessing`` manager its ``torch_dist`` writer
keeps for the rank's lifetime (spawned), and whatever a library adds later. A parent-death
signal set in the rank (``PR_SET_PDEATHSIG``) ends the rank alone: Linux clears it in every
child, so those children outlived a killed launcher, parented to init. (W&B's service leaves
for a session of its own and ends by itself: it watches the pid of the rank that started it.)

One mechanism covers them all, of every kind: a rank leads a process group of its own
(`lead_process_group`); what it starts stays in that group unless it leaves on purpose; and the
group is killed as one (`kill_process_group`):

- when the rank's parent dies (the launcher, or torchrun's agent, killed even by SIGKILL), by a
  watchdog thread in the rank (`end_group_with_parent`), woken by the kernel through a pidfd
  the moment the parent exits;
- when the rank itself dies, by its parent: the demo's launcher kills each rank's group before it
  reaps the rank, and torchrun's agent kills each worker's group (its workers lead sessions of
  their own) when it stops them.

Linux and other POSIX systems; a system without pidfds polls the parent pid once a second.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time


def lead_process_group() -> None:
    """Make this process the leader of a new process group, holding all it will start.

    A session leader (torchrun's workers) already leads its group and keeps it.
    """
    if os.getpgrp() == os.getpid():
        return
    os.setpgid(0, 0)


def kill_process_group(pgid: int) -> None:
    """SIGKILL every process of the group ``pgid`` (gone already: nothing to do)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _end_group() -> None:
    """Kill this process's group when it leads one, else this process alone."""
    if os.getpgrp() == os.getpid():
        kill_process_group(os.getpid())
    os.kill(os.getpid(), signal.SIGKILL)


def _parent_exit_fd(parent_pid: int) -> int | None:
    """A file descriptor that becomes readable when ``parent_pid`` exits (a pidfd), or None
    where the system has none. Raises ProcessLookupError when the parent is already gone."""
    if not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(parent_pid)
    except OSError as exc:
        if isinstance(exc, ProcessLookupError):
            raise
        return None  # a kernel older than 5.3


def end_group_with_parent(parent_pid: int) -> None:
    """Kill this process's group (this process and all it starts) when ``parent_pid`` exits.

    Call it in the rank, after `lead_process_group`, with the pid of the process that started
    it. A parent that is gone already ends the group at once.
    """
    try:
        fd = _parent_exit_fd(parent_pid)
    except ProcessLookupError:
        _end_group()
        return
    if os.getppid() != parent_pid:  # the parent died (and its pid may be reused) before now
        _end_group()

    def watch() -> None:
        if fd is not None:
            waiter = select.poll()
            waiter.register(fd, select.POLLIN)
            while not waiter.poll():
                pass
        else:
            while os.getppid() == parent_pid:
                time.sleep(1.0)
        _end_group()

    threading.Thread(target=watch, name="end-group-with-parent", daemon=True).start()


def end_with_torchrun_agent() -> None:
    """Under torchrun, end this rank and all it starts when torchrun's agent ends.

    torchrun starts each worker as the leader of a session of its own and kills that session when
    it stops the workers; a killed agent stops nothing, and its workers trained on, parented to
    init. Outside torchrun (its agent sets ``TORCHELASTIC_RUN_ID``) this does nothing.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    lead_process_group()
    end_group_with_parent(os.getppid())


def clear_parent_death_signal() -> None:
    """Remove a parent-death signal set before (torch's spawn sets SIGINT): the group watchdog
    ends the rank with its children, and a signal to the rank alone would end it first."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, 0, 0, 0, 0)


__all__ = ["clear_parent_death_signal", "end_group_with_parent", "end_with_torchrun_agent",
           "kill_process_group", "lead_process_group"]
