"""Everything megatron-core needs to run on a CPU-only torch build, kept in one place.

megatron-core assumes CUDA in a few spots that a tiny CPU model still reaches. Each entry's last
line names the GPU code path it stands in for and the test that covers the library's own side of
it (the GPU tier is ``tests/gpu``, docs/gpu.md):

1. ``model_parallel_cuda_manual_seed`` needs CUDA, so the tensor-parallel RNG tracker is
   initialised directly instead.
   GPU: ``model_parallel_cuda_manual_seed``, `apply_cpu_workarounds` a no-op; covered: tests/gpu/test_gpu_workarounds.py::test_the_cpu_workarounds_change_nothing_where_cuda_exists.
2. Some layers ask ``torch.cuda.current_device()`` for a device; it is answered with ``"cpu"``.
   megatron-core 0.19's DDP grad sync also asks ``torch.cuda.current_stream()`` (to wait for
   CUDA-graph events); it is answered with a stand-in whose waits do nothing, since CPU work
   is already ordered (a CUDA build of torch on a machine without a GPU would fail there).
   GPU: the real device and stream, left unpatched; covered: tests/gpu/test_gpu_workarounds.py::test_the_cpu_workarounds_change_nothing_where_cuda_exists.
3. The schedules allocate their token counter with ``device="cuda"``, and the megatron-core
   optimizers (``get_megatron_optimizer``, ``step()``, gradient clipping) allocate their loss
   scale, overflow flags and norms the same way; `cuda_factories_on_cpu` redirects tensor
   factories that name CUDA to the CPU while a schedule, the optimizer's construction or its
   step runs.
   GPU: those tensors on the device, the mode not entered; covered: tests/gpu/test_gpu_workarounds.py::test_the_cpu_workarounds_change_nothing_where_cuda_exists.
4. The distributed optimizer picks a parameter's branch by ``param.type()`` and rejects any
   name but ``torch.cuda.{Float,Half,BFloat16}Tensor``; gradient clipping asserts
   ``grad.type() == "torch.cuda.FloatTensor"``. While the optimizer is built and stepped,
   ``.type()`` (no arguments) of a CPU floating tensor answers with the CUDA name.
   GPU: the tensors' own CUDA type names; covered: tests/gpu/test_gpu_workarounds.py::test_the_cpu_workarounds_change_nothing_where_cuda_exists.
5. float64 (used for exact equivalence checks) is no type the distributed optimizer knows:
   while the optimizer is built and stepped, a float64 tensor's ``.type()`` answers
   ``torch.cuda.FloatTensor`` (the full-precision branch, which shards the parameter as it is)
   and its ``.float()`` returns it unchanged (the branch casts gradients with ``.float()``), so a
   float64 run keeps float64 parameters, gradients and Adam state. No-op for other dtypes.
   GPU: float64 ``.float()`` casts as usual; covered: tests/gpu/test_gpu_workarounds.py::test_the_cpu_workarounds_change_nothing_where_cuda_exists.
6. megatron-core's checkpoint writer (``dist_checkpointing``'s ``torch_dist`` strategy) calls
   ``torch.cuda.synchronize()`` before it copies tensors out; with no CUDA device there is
   nothing to wait for, so it returns at once.
   GPU: the writer's real synchronize; covered: tests/gpu/test_gpu_workarounds.py (left unpatched) and test_gpu_checkpoint.py (the writer on CUDA).

`megatron_optimizer_compat` applies 3 to 5; wrap ``get_megatron_optimizer`` and every
``optimizer.step()`` in it (`megatron_packing.megatron.ddp` and `train_step` do).

megatron-core ``DistributedDataParallel`` itself needs nothing: it builds its grad buffers on
the CPU and reduces them with gloo, with or without ``overlap_grad_reduce`` (gloo runs the
async all-reduce / reduce-scatter), and with the distributed optimizer's all-gather. Only
``num_distributed_optimizer_instances > 1`` creates a CUDA stream; `ddp.wrap_in_ddp` refuses it
on CPU.

Attention also needs an explicit boolean mask on CPU (``attention_mask=None`` builds one on
CUDA); `megatron_packing.megatron.packed_seq.block_diagonal_causal_mask` provides it.
None of these is applied on a machine with CUDA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _nothing_to_wait_for(device: Any = None) -> None:
    """``torch.cuda.synchronize`` on a machine without CUDA (workaround 6)."""


def cpu_only() -> bool:
    """True when megatron-core has to run on the CPU."""
    return not torch.cuda.is_available()


def apply_cpu_workarounds() -> None:
    """Patch the process for CPU megatron-core (workarounds 1, 2 and 6). Idempotent; no-op on
    GPU."""
    if not cpu_only():
        return
    from megatron.core import tensor_parallel

    torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
    torch.cuda.synchronize = _nothing_to_wait_for
    torch.cuda.current_stream = _cpu_current_stream  # type: ignore[assignment]
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def _cpu_current_device() -> str:
    return "cpu"


class _CpuStream:
    """What megatron-core asks of the current stream on CPU: waits that have nothing to wait for."""

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _cpu_current_stream(device: Any = None) -> _CpuStream:
    return _CpuStream()


class _CudaFactoriesOnCpu(TorchFunctionMode):
    """Rewrites ``device="cuda"`` keyword arguments of torch calls to ``"cpu"``."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float64: "torch.cuda.FloatTensor",  # the full-precision branch (workaround 5)
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


class _OptimizerTensorTypes(TorchFunctionMode):
    """``.type()`` of a CPU tensor answers its CUDA name; float64 ``.float()`` keeps float64.

    Workarounds 4 and 5 (entered on CPU only, by `megatron_optimizer_compat`).
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
            tensor = args[0]
            if func is torch.Tensor.float and tensor.dtype == torch.float64:
                return tensor
            if func is torch.Tensor.type and tensor.device.type == "cpu" \
                    and tensor.dtype in _CUDA_TYPE_NAMES:
                return _CUDA_TYPE_NAMES[tensor.dtype]
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_factories_on_cpu() -> Iterator[None]:
    """While active, tensors that megatron-core allocates on CUDA land on the CPU (workaround 3)."""
    if not cpu_only():
        yield
        return
    with _CudaFactoriesOnCpu():
        yield


@contextlib.contextmanager
def megatron_optimizer_compat() -> Iterator[None]:
    """Workarounds 3 to 5: wrap building and stepping a megatron-core optimizer (CPU only).

    On a machine with CUDA nothing is entered: a torch-function mode would put a Python call in
    front of every operation of every optimizer step.
    """
    if not cpu_only():
        yield
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(cuda_factories_on_cpu())
        stack.enter_context(_OptimizerTensorTypes())
        yield
