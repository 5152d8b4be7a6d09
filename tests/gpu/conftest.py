"""Fixtures of the GPU tier: one NCCL process group of world size 1 with megatron-core's parallel
state, for the tests that run in this process (the entry-point tests launch their own)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="session")
def nccl_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``torch.distributed`` on NCCL (rank 0 of 1, rendezvous through a file), megatron-core's
    model-parallel groups (all of size 1) and its CUDA RNG tracker seeded."""
    from megatron.core import parallel_state, tensor_parallel

    store = Path(tmp_path_factory.mktemp("nccl")) / "rendezvous"
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store}", world_size=1, rank=0)
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
