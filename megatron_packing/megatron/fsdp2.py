"""The demo trainer's ``fsdp2`` backend: torch's FSDP2 (``fully_shard``) over the DP group.

Each transformer layer is one FSDP2 unit and the whole model is the root unit, on a ``"cpu"``
device mesh built from the data-parallel process group (gloo). FSDP2 all-gathers a unit's
parameters before its forward and backward and reduce-scatters its gradients after the
backward. The reduce-scatter SUMS (divide factor 1): the loss of each micro-batch is already
divided by the step's global loss-token count, so the summed gradient is the global one, as
with the plain backend's all-reduce. Any torch optimizer then steps the sharded parameters.

Every rank must run the same number of forward/backward passes per step (each one is a
collective); padded mode guarantees it with dummy micro-batches.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist


def is_fsdp2(model: torch.nn.Module) -> bool:
    """True for a module wrapped by ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def wrap_in_fsdp2(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> torch.nn.Module:
    """Shard ``model`` (a megatron-core GPTModel) in place with FSDP2 and return it.

    ``group``: the DP process group (default: the world). Every rank must hold the same
    weights before the call (broadcast them first): sharding keeps each rank's own slice.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = DeviceMesh.from_group(group if group is not None else _world(), "cpu")
    layers: Any = model.decoder.layers  # type: ignore[union-attr]
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # SUM: the loss carries the 1 / N
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM (float32)
    return model


def _world() -> dist.ProcessGroup:
    world = dist.group.WORLD
    if world is None:
        raise RuntimeError("FSDP2 needs an initialised process group (dist.init_process_group)")
    return world


def clip_and_norm(model: torch.nn.Module, clip_grad: float | None) -> float:
    """The global gradient norm of the sharded gradients; clipped to ``clip_grad`` when set.

    A collective (the norm sums the shards over the mesh): call it on every rank.
    """
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = clip_grad if clip_grad else math.inf
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)

