"""Model and optimizer state through the distributed checkpoint libraries, sharded on disk.

The ``megatron_ddp`` backend writes megatron-core's ``dist_checkpointing`` format (the default
``torch_dist`` strategy, each tensor written once, the writes spread over the data-parallel
ranks as Megatron-LM does by default); the ``fsdp2`` backend writes torch's
``torch.distributed.checkpoint`` format from the ranks' own shards, with no full-state gather.
Both are collective: every rank calls them with the same directory. What is per rank (the LR
schedule, the loader state) stays in the demo's rank files (`demo.checkpoint`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class WeightsMismatch(RuntimeError):
    """The saved model or optimizer does not fit the one this run built."""


def save_weights(model: Any, optimizer: Any, directory: Path, *, fsdp2: bool) -> None:
    """Write ``model`` and ``optimizer`` into the empty ``directory`` (collective)."""
    if fsdp2:
        import torch.distributed.checkpoint as dcp

        dcp.save(_fsdp2_state(model, optimizer), checkpoint_id=str(directory))
        return
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    strategy = FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy(),
        parallel_state.get_data_parallel_group(with_context_parallel=True))
    dist_checkpointing.save(_megatron_state(model, optimizer, loading=False), str(directory),
                            strategy)


def load_weights(model: Any, optimizer: Any, directory: Path, *, fsdp2: bool) -> None:
    """Load what `save_weights` wrote into this run's ``model`` and ``optimizer`` (collective).

    Raises `WeightsMismatch` when the saved tensors do not fit (another model size or backend).
    """
    from megatron.core.dist_checkpointing.core import CheckpointingException

    try:
        if fsdp2:
            _load_fsdp2(model, optimizer, directory)
            return
        from megatron.core import dist_checkpointing

        loaded = dist_checkpointing.load(_megatron_state(model, optimizer, loading=True),
                                         str(directory))
        model.module.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
    except (CheckpointingException, KeyError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise WeightsMismatch(first) from None


def load_model(model: Any, directory: Path) -> None:
    """Load only the model of a ``megatron_ddp`` checkpoint into a bare megatron-core model
    (not wrapped in DDP), on any number of ranks: to evaluate or export saved weights."""
    from megatron.core import dist_checkpointing

    model.load_state_dict(dist_checkpointing.load(
        {"model": model.sharded_state_dict()}, str(directory))["model"])


def _megatron_state(model: Any, optimizer: Any, *, loading: bool) -> dict[str, Any]:
    """The sharded state dict of a megatron-core DDP model and its megatron-core optimizer."""
    model_state = model.module.sharded_state_dict()
    return {"model": model_state,
            "optimizer": optimizer.sharded_state_dict(model_state, is_loading=loading)}


def _fsdp2_state(model: Any, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def _load_fsdp2(model: Any, optimizer: Any, directory: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _fsdp2_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
