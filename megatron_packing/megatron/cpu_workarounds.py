"""Everything megatron-core needs to run on a CPU-only torch build, kept in one place.

megatron-core assumes CUDA in a few spots that a tiny CPU model still reaches:

1. ``model_parallel_cuda_manual_seed`` needs CUDA, so the tensor-parallel RNG tracker is
   initialised directly instead.
2. Some layers ask ``torch.cuda.current_device()`` for a device; it is answered with ``"cpu"``.
3. The schedules allocate their token counter with ``device="cuda"``; `cuda_factories_on_cpu`
   redirects tensor factories that name CUDA to the CPU while a schedule runs.

Attention also needs an explicit boolean mask on CPU (``attention_mask=None`` builds one on
CUDA); `megatron_packing.megatron.packed_seq.block_diagonal_causal_mask` provides it.
None of this is applied on a machine with CUDA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def cpu_only() -> bool:
    """True when megatron-core has to run on the CPU."""
    return not torch.cuda.is_available()


def apply_cpu_workarounds() -> None:
    """Patch the process for CPU megatron-core (workarounds 1 and 2). Idempotent; no-op on GPU."""
    if not cpu_only():
        return
    from megatron.core import tensor_parallel

    torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def _cpu_current_device() -> str:
    return "cpu"


class _CudaFactoriesOnCpu(TorchFunctionMode):
    """Rewrites ``device="cuda"`` keyword arguments of torch calls to ``"cpu"``."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_factories_on_cpu() -> Iterator[None]:
    """While active, tensors that megatron-core allocates on CUDA land on the CPU (workaround 3)."""
    if not cpu_only():
        yield
        return
    with _CudaFactoriesOnCpu():
        yield
