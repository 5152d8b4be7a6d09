"""Functions run inside spawned gloo processes forming one tensor-parallel group (tp = 2)."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lm_rows import random_rows

from megatron_packing.megatron.launch import free_port
from megatron_packing.megatron.lm_batch import broadcast_batch_across_tp, to_megatron_lm_batch

ROWS_SEED = 11
NUM_ROWS = 6


def _entry(rank: int, fn: Callable[[int, str], None], world: int, port: int, out_dir: str) -> None:
    from megatron.core import parallel_state

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        fn(rank, out_dir)
    except BaseException:
        print(f"[tp rank {rank}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def spawn_tensor_parallel(fn: Callable[[int, str], None], world: int, out_dir: str) -> None:
    """Run ``fn(rank, out_dir)`` on ``world`` processes that form a single TP group."""
    mp.spawn(_entry, args=(fn, world, free_port(), out_dir), nprocs=world, join=True)


def broadcast_rows(rank: int, out_dir: str) -> None:
    """TP rank 0 sends rows of varying length and sequence count; every rank saves what it has."""
    from megatron.core import parallel_state

    source = parallel_state.get_tensor_model_parallel_rank() == 0
    received = []
    for row in random_rows(NUM_ROWS, seed=ROWS_SEED):
        batch = to_megatron_lm_batch(row) if source else None
        received.append(broadcast_batch_across_tp(batch))
    torch.save(received, Path(out_dir, f"rank{rank}.pt"))
