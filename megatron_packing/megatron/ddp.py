"""megatron-core ``DistributedDataParallel`` and optimizer, set up the way `train_step` needs.

With megatron-core DDP the gradients accumulate in ``param.main_grad`` (views into contiguous
grad buffers) and ``param.grad`` stays empty; the DDP reduces the buffers in
``finish_grad_sync``, which megatron-core's ``finalize_model_grads`` calls and which then
divides by the all-reduced loss-token count (``calculate_per_token_loss=True``). The
megatron-core optimizer reads those buffers. So the DDP path must use Megatron's own grad
finalization; a reduction of ``param.grad`` would reduce nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from megatron_packing.megatron.cpu_workarounds import megatron_optimizer_compat

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig
    from megatron.core.transformer.module import MegatronModule


def is_megatron_ddp(model: torch.nn.Module) -> bool:
    """True for a model wrapped in megatron-core ``DistributedDataParallel``."""
    from megatron.core.distributed import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


def wrap_in_ddp(model: MegatronModule, ddp_config: DistributedDataParallelConfig
                ) -> DistributedDataParallel:
    """Wrap a megatron-core model whose config divides by the global loss-token count once.

    Needs ``calculate_per_token_loss=True`` (as `build_tiny_gpt` sets): then the DDP sums
    gradients over ranks and ``finalize_model_grads`` divides by the all-reduced token count.
    Keep ``grad_reduce_in_fp32=False`` for float64 models, or the buffers drop to float32.
    """
    from megatron.core.distributed import DistributedDataParallel

    config = model.config
    if not config.calculate_per_token_loss:
        raise ValueError("model config calculate_per_token_loss=False: the DDP train step needs "
                         "True, so gradients are divided once by the global loss-token count")
    if ddp_config.num_distributed_optimizer_instances != 1 and not torch.cuda.is_available():
        raise ValueError(f"num_distributed_optimizer_instances="
                         f"{ddp_config.num_distributed_optimizer_instances} needs CUDA streams; "
                         "use 1 on CPU")
    return DistributedDataParallel(config, ddp_config, model)


def build_megatron_optimizer(model: DistributedDataParallel, optimizer_config: OptimizerConfig,
                             **kwargs: Any) -> MegatronOptimizer:
    """``get_megatron_optimizer`` for one DDP model chunk, with the CPU / float64 workarounds."""
    from megatron.core.optimizer import get_megatron_optimizer

    if not is_megatron_ddp(model):
        raise TypeError(f"expected a megatron-core DistributedDataParallel model, "
                        f"got {type(model).__name__}; wrap it with wrap_in_ddp first")
    ddp_distributed = model.ddp_config.use_distributed_optimizer
    if optimizer_config.use_distributed_optimizer != ddp_distributed:
        raise ValueError(f"OptimizerConfig.use_distributed_optimizer="
                         f"{optimizer_config.use_distributed_optimizer} but the model's "
                         f"DistributedDataParallelConfig says {ddp_distributed}; they must match")
    with megatron_optimizer_compat():
        return get_megatron_optimizer(optimizer_config, [model], **kwargs)


def wire_megatron_grad_sync(model: DistributedDataParallel | list[DistributedDataParallel], *,
                            align_grad_reduce: bool = True,
                            align_param_gather: bool = True) -> None:
    """Set the schedule's grad-sync hooks on the model config as Megatron-LM's ``train()`` does.

    ``model`` is one DDP module or the list of model chunks. ``finalize_model_grads`` always;
    ``no_sync_func`` (and, when aligned, ``grad_sync_func``) only with ``overlap_grad_reduce``:
    backward then starts bucket reductions as grads become ready and the schedule holds them
    off until the last micro-batch; ``param_sync_func`` only with an aligned
    ``overlap_param_gather``. `train_step` also sets ``grad_scale_func`` to the optimizer's.
    """
    from megatron.core.distributed import finalize_model_grads

    chunks = model if isinstance(model, list) else [model]

    def hook(name: str) -> Any:
        hooks = [getattr(chunk, name) for chunk in chunks]
        return hooks[0] if len(hooks) == 1 else hooks

    config = chunks[0].config
    ddp_config = chunks[0].ddp_config
    config.finalize_model_grads_func = finalize_model_grads
    overlap = ddp_config.overlap_grad_reduce
    config.no_sync_func = hook("no_sync") if overlap else None
    config.grad_sync_func = hook("start_grad_sync") if overlap and align_grad_reduce else None
    config.param_sync_func = (hook("start_param_sync")
                              if ddp_config.overlap_param_gather and align_param_gather else None)
