"""Rank functions for the launcher tests (importable by name in spawned processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import torch.distributed as dist

from megatron_packing.common.validation import ConfigError


def refuse_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        raise ConfigError("train.yaml: packing.seed must be an integer >= 0, got -1")
    dist.barrier()  # rank 0 waits on its peer, which is gone


def bug_on_rank_0(rank: int, world: int) -> None:
    if rank == 0:
        {}["world_size"]  # noqa: B018 - a library bug: a KeyError
    dist.barrier()


def killed_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def succeed(rank: int, world: int) -> None:
    dist.barrier()


def killed_with_a_child_on_rank_1(rank: int, world: int, pid_file: str) -> None:
    """Rank 1 starts a process of its own, records its pid, then is killed by SIGKILL."""
    if rank == 1:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        with open(pid_file, "w") as f:
            f.write(str(child.pid))
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
