"""Functions run inside spawned gloo processes forming one tensor-parallel group (tp = 2)."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lm_rows import random_rows
from megatron_lm_runs import MEGATRON_LM

from megatron_packing.demo.launch import free_port
from megatron_packing.megatron.lm_batch import broadcast_batch_across_tp, to_megatron_lm_batch

ROWS_SEED = 11
NUM_ROWS = 6
# Megatron-LM checkout (core_v0.16.1), or None: the megatron.training of megatron-core 0.19's wheel.
MEGATRON_LM_DIR = MEGATRON_LM
MEGATRON_TP_FILE = "rank{}_megatron.pt"


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


def spawn_tensor_parallel(fn: Callable[[int, str], None], world: int, out_dir: str,
                          timeout_s: float = 300.0) -> None:
    """Run ``fn(rank, out_dir)`` on ``world`` processes that form a single TP group.

    Mismatched collectives hang rather than fail, so ranks still running after ``timeout_s``
    are terminated and the call raises.
    """
    context = mp.start_processes(_entry, args=(fn, world, free_port(), out_dir), nprocs=world,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            raise TimeoutError(f"TP ranks did not finish within {timeout_s} s (collective mismatch?)")


def broadcast_rows(rank: int, out_dir: str) -> None:
    """TP rank 0 sends rows of varying length and sequence count; every rank saves what it has."""
    from megatron.core import parallel_state

    source = parallel_state.get_tensor_model_parallel_rank() == 0
    received = []
    for row in random_rows(NUM_ROWS, seed=ROWS_SEED):
        batch = to_megatron_lm_batch(row) if source else None
        received.append(broadcast_batch_across_tp(batch))
    torch.save(received, Path(out_dir, f"rank{rank}.pt"))


def megatron_lm_tp_function() -> Callable | None:
    """Megatron-LM's own ``get_batch_on_this_tp_rank`` with its ``get_args`` given, or None.

    Runs in a spawned worker: Megatron-LM's folder goes on ``sys.path`` and the CPU shims of
    `cpu_shims` answer its CUDA calls.
    """
    if MEGATRON_LM_DIR is None:  # the installed megatron-core's megatron.training
        if importlib.util.find_spec("megatron.training") is None:
            return None
    elif not (MEGATRON_LM_DIR / "megatron" / "training" / "utils.py").is_file():
        return None
    elif str(MEGATRON_LM_DIR) not in sys.path:
        sys.path.insert(0, str(MEGATRON_LM_DIR))
    import cpu_shims
    from megatron.training import utils

    if not hasattr(utils, "get_batch_on_this_tp_rank"):  # megatron-core 0.19 moved it
        return None
    cpu_shims.apply()

    def get_batch(args: SimpleNamespace, data_iterator):
        utils.get_args = lambda: args
        return utils.get_batch_on_this_tp_rank(data_iterator)

    return get_batch


def megatron_lm_broadcast(rank: int, out_dir: str) -> None:
    """Megatron-LM's TP broadcast of one padded row, on CPU (with the CPU shims).

    The source's dict carries no ``max_seqlen``: the receivers in this version allocate no
    buffer for it (outside hybrid CP) while the source broadcasts it, so the collectives would
    no longer pair up.
    """
    from megatron.core import parallel_state

    get_batch_on_this_tp_rank = megatron_lm_tp_function()
    if get_batch_on_this_tp_rank is None:
        return
    row = random_rows(NUM_ROWS, seed=ROWS_SEED)[0]
    data = to_megatron_lm_batch(row)
    data.pop("max_seqlen")
    args = SimpleNamespace(hybrid_context_parallel=False, pipeline_model_parallel_size=1,
                           micro_batch_size=1, seq_length=int(row.tokens.shape[1]),
                           create_attention_mask_in_dataloader=False, sft=True)
    source = parallel_state.get_tensor_model_parallel_rank() == 0
    got = get_batch_on_this_tp_rank(args, iter([data]) if source else None)
    torch.save(got, Path(out_dir, MEGATRON_TP_FILE.format(rank)))


def broadcast_rows_then_megatron(rank: int, out_dir: str) -> None:
    """Both broadcasts in one spawn: process start-up dominates their cost."""
    broadcast_rows(rank, out_dir)
    megatron_lm_broadcast(rank, out_dir)
