"""DP-aligned sequence packing for Megatron supervised fine-tuning.

The public names are re-exported lazily, so that ``import megatron_packing.packing`` (pure
numpy) never pulls in torch, megatron-core or transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # packing core (numpy only)
    "Alignment": "megatron_packing.packing.alignment",
    "make_alignment": "megatron_packing.packing.alignment",
    "PackingAlgorithm": "megatron_packing.packing.algorithms",
    "OversizePolicy": "megatron_packing.packing.algorithms",
    "SeqPacker": "megatron_packing.packing.algorithms",
    "make_seq_packer": "megatron_packing.packing.factory",
    "make_sft_sequence_packer": "megatron_packing.packing.factory",
    "assign_bins_to_ranks": "megatron_packing.packing.balance",
    "make_token_balanced_microbatches": "megatron_packing.packing.microbatch",
    # sampler, collator, config, loader (torch)
    "DPAlignedPackingBatchSampler": "megatron_packing.packed.sampler",
    "StepPlan": "megatron_packing.common.plan_types",
    "PackedCollator": "megatron_packing.packed.collate",
    "PackedBatch": "megatron_packing.packed.collate",
    "PackedMicroBatch": "megatron_packing.packed.collate",
    "StepMetadata": "megatron_packing.common.plan_types",
    "PackingConfig": "megatron_packing.config",
    "load_config": "megatron_packing.config",
    "build_sft_dataloader": "megatron_packing.loader.dataloader",
    "align_microbatch_count": "megatron_packing.padded.sync",
    # data
    "load_sft_dataset": "megatron_packing.data",
    "SFTDataset": "megatron_packing.data",
}

__all__ = sorted(_EXPORTS)

def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'megatron_packing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
