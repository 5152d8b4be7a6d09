"""Start data-parallel worker processes on CPU (gloo) with megatron parallel state initialised."""

from __future__ import annotations

import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that was free a moment ago, for the rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_data_parallel(rank: int, world_size: int, port: int, *, threads: int = 1) -> None:
    """gloo process group + megatron parallel state (tp = pp = cp = 1, dp = world size)."""
    from megatron.core import parallel_state

    from megatron_packing.megatron.cpu_workarounds import apply_cpu_workarounds

    torch.set_num_threads(threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                             pipeline_model_parallel_size=1)
    apply_cpu_workarounds()


def shutdown_data_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, args: tuple) -> None:
    init_data_parallel(rank, world_size, port)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        # Print every rank's own failure: the launcher only re-raises the first one.
        print(f"[dp rank {rank}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    finally:
        shutdown_data_parallel()


def spawn_data_parallel(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes; raise if any fails.

    ``fn`` must be importable by name (a module-level function).
    """
    mp.spawn(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True)


def dp_group() -> dist.ProcessGroup:
    """Megatron's data-parallel group."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group()
