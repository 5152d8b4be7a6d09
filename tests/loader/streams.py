"""Loader stream helpers: comparable batch records and a trainer-like epoch loop."""

from __future__ import annotations

import dataclasses

import numpy as np
from sampler.synthetic import SyntheticSFT, mixed_lengths

from megatron_packing.config import PackingConfig
from megatron_packing.loader.dataloader import build_sft_dataloader

DATASET = SyntheticSFT(mixed_lengths(160, seed=5, high=700))
BATCH = 30  # 6 steps per epoch, the last one takes what remains


def config(**overrides) -> PackingConfig:
    values = dict(global_batch_size=BATCH, bin_capacity=1024, align_packing_bins_to_dp=True,
                  packing_batch_size_allowed_variation=0.1, base_order="random")
    values.update(overrides)
    return PackingConfig(**values)


def make_loader(dp_rank=0, dp_size=2, num_workers=0, persistent_workers=False, dataset=DATASET,
                total_steps=None, **overrides):
    return build_sft_dataloader(dataset, config(**overrides), dp_rank=dp_rank, dp_size=dp_size,
                                seed=11, num_workers=num_workers,
                                persistent_workers=persistent_workers, total_steps=total_steps)


def record(batch) -> tuple:
    """Everything in a batch, bit for bit (the plan's wall-clock time excepted)."""
    rows = tuple(
        (tuple((t.dtype, tuple(t.shape), t.numpy().tobytes())
               for t in (mb.tokens, mb.labels, mb.loss_mask, mb.position_ids,
                         mb.cu_seqlens, mb.cu_seqlens_padded)),
         mb.max_seqlen, mb.example_indices, mb.is_placeholder)
        for mb in batch.micro_batches
    )
    return rows, dataclasses.replace(batch.meta, plan_ms=0.0)


def epochs(loader, count: int) -> list[list[tuple]]:
    """``count`` iterations of the loader (one epoch each), as records."""
    return [[record(b) for b in loader] for _ in range(count)]


def examples_of(batch) -> list[int]:
    return [i for mb in batch.micro_batches for i in mb.example_indices]


def as_array(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)
