"""Test support: what Megatron-LM's training package needs to run on a CPU-only torch build.

Megatron-LM targets CUDA. The integration's tests drive its real entry points
(``initialize_megatron``, ``setup_model_and_optimizer``, ``save_checkpoint`` / ``load_checkpoint``,
the schedules) on CPU with gloo, so the places where it assumes a GPU are answered here, from
outside, and only when no CUDA device exists. Nothing of this ships in the library.

Each shim and the stop it passes; its last line names the GPU code path it stands in for and the
test that covers the library's own side of it (the GPU tier is ``tests/gpu``, docs/gpu.md).

1. ``torch.cuda.current_device`` answers ``"cpu"``; ``torch.cuda.Stream`` / ``stream`` /
   ``current_stream`` / ``synchronize`` / ``empty_cache``, ``Module.cuda`` and ``Tensor.cuda``
   become no-ops (``get_model`` moves the model to the GPU, tied embeddings under PP move there to
   be summed, and ``get_model`` wraps DDP construction in a side stream; timers synchronize). The
   checkpoint's CUDA RNG state is the CPU generator's (nothing here draws from a CUDA generator).
   GPU: model, DDP, timers and the checkpoint's RNG on the device; covered: tests/gpu/test_gpu_entry_point.py (all three).
2. ``_initialize_distributed`` skips model-parallel set-up when no GPU is counted: the shim runs
   megatron-core's ``initialize_model_parallel`` with the parsed sizes right after it.
   GPU: Megatron's own model-parallel set-up; covered: tests/gpu/test_gpu_entry_point.py (size 1; no library code).
3. ``_set_random_seed`` seeds the CUDA RNG tracker only with a GPU; the shim initialises the
   tensor-parallel RNG tracker directly, as megatron-core's CPU tests do.
   GPU: ``model_parallel_cuda_manual_seed``; covered: tests/gpu/test_gpu_entry_point.py::test_a_run_killed_after_its_checkpoint_resumes_as_the_uninterrupted_run.
4. The local ``DotProductAttention`` refuses ``context_parallel_size > 1`` (CP attention needs
   Transformer Engine). On CPU every CP rank attends over the whole packed row with the exact
   block-diagonal mask and trains only its CP share of the tokens, so the model is built with a
   CP size of 1 while the process groups keep CP = 2.
   GPU: TE's THD attention on the rank's CP slice (`forward._forward_thd`); covered (CPU only: CP needs TE and 2 GPUs): tests/megatron_lm/test_lm_batch.py::test_cp_slices_split_loss_tokens_and_merge_back.
5. Argument validation asks the GPU's architecture when TP > 1; the shim answers 9 (Hopper).
   GPU: ``get_device_arch_version`` (Megatron's, no library code); covered: tests/megatron_lm/test_parallelism.py::test_tp2_and_cp2_reproduce_the_single_process_run.
6. megatron-core 0.16's MoE router tests ``te_general_gemm is not None``, a name its module
   defines only when Transformer Engine imports; without it the name is bound to None, which
   is what that test means (the entry point refuses MoE in that case outside the tests).
   GPU: the router on TE's GEMM; covered: tests/megatron_lm/test_arguments.py::test_moe_is_refused_where_megatron_cores_router_cannot_run.
7. Tensor factories that name ``device="cuda"`` (the optimizer's loss scale, the schedules'
   token counters, DDP buffers) are redirected to the CPU for the whole process by entering the
   library's ``cuda_factories_on_cpu`` mode once.
   GPU: those tensors on the device, the library's mode a no-op; covered: tests/gpu/test_gpu_workarounds.py::test_the_cpu_workarounds_change_nothing_where_cuda_exists.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class _NoStream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    cuda.Stream = _NoStream  # type: ignore[assignment,misc]
    cuda.stream = lambda *_a, **_k: contextlib.nullcontext()  # type: ignore[assignment]
    cuda.current_stream = lambda *_a, **_k: _NoStream()  # type: ignore[assignment]
    cuda.synchronize = lambda *_a, **_k: None  # type: ignore[assignment]
    cuda.empty_cache = lambda: None  # type: ignore[assignment]
    torch.nn.Module.cuda = lambda self, *_a, **_k: self  # type: ignore[method-assign]
    torch.Tensor.cuda = lambda self, *_a, **_k: self  # type: ignore[method-assign]
    cuda.get_rng_state = lambda *_a, **_k: torch.get_rng_state()  # type: ignore[assignment]
    cuda.set_rng_state = lambda *_a, **_k: None  # type: ignore[assignment]


def _patch_initialize() -> None:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.training import initialize

    original_distributed = initialize._initialize_distributed

    def initialize_distributed(*args: Any, **kwargs: Any) -> None:
        original_distributed(*args, **kwargs)
        from megatron.training import get_args

        margs = get_args()
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(
                margs.tensor_model_parallel_size,
                margs.pipeline_model_parallel_size,
                margs.virtual_pipeline_model_parallel_size,
                context_parallel_size=margs.context_parallel_size,
                distributed_timeout_minutes=margs.distributed_timeout_minutes,
            )

    original_seed = initialize._set_random_seed

    def set_random_seed(seed: int, *args: Any, **kwargs: Any) -> None:
        original_seed(seed, *args, **kwargs)
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

    initialize._initialize_distributed = initialize_distributed
    initialize._set_random_seed = set_random_seed


def _patch_device_queries() -> None:
    from megatron.training import arguments, utils

    def device_arch_version() -> int:
        return 9

    utils.get_device_arch_version = device_arch_version
    if hasattr(arguments, "get_device_arch_version"):
        arguments.get_device_arch_version = device_arch_version


def _patch_moe_router() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_context_parallel_attention() -> None:
    from megatron.training import arguments

    original = arguments.core_transformer_config_from_args

    def config_from_args(args: Any, *rest: Any, **kwargs: Any) -> Any:
        config = original(args, *rest, **kwargs)
        config.context_parallel_size = 1
        return config

    arguments.core_transformer_config_from_args = config_from_args
    try:  # a Megatron-LM checkout's builder imported the name itself
        import gpt_builders
    except ImportError:  # no checkout: the library's provider looks it up when it builds
        return
    if getattr(gpt_builders, "core_transformer_config_from_args", None) is original:
        gpt_builders.core_transformer_config_from_args = config_from_args


_GLOBAL_MODES: list[Any] = []



def apply() -> None:
    """Apply every shim; a no-op where CUDA exists."""
    if torch.cuda.is_available():
        return
    from megatron_packing.megatron.cpu_workarounds import cuda_factories_on_cpu

    mode = cuda_factories_on_cpu()
    mode.__enter__()
    _GLOBAL_MODES.append(mode)
    _patch_torch_cuda()
    _patch_initialize()
    _patch_device_queries()
    _patch_context_parallel_attention()
    _patch_moe_router()
