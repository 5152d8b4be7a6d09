"""Rank functions for the launcher tests (importable by name in spawned processes)."""

from __future__ import annotations

import os
import signal
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
