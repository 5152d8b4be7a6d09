"""The padded mode's loader parts, built from a `PackingConfig`: sampler, fetch wrapper, collator."""

from __future__ import annotations

from typing import Any

import numpy as np

from megatron_packing.base_order import make_base_order
from megatron_packing.fetch import PlannedDataset
from megatron_packing.padded.collate import PaddedCollator
from megatron_packing.padded.sampler import TokenBudgetBatchSampler


def build_padded_components(
    dataset: Any,
    config: Any,
    *,
    dp_rank: int,
    dp_size: int,
    seed: int,
    total_steps: int | None = None,
    eval_mode: bool = False,
    base_sampler: Any = None,
) -> tuple[TokenBudgetBatchSampler, PlannedDataset, PaddedCollator]:
    """(batch_sampler, dataset_wrapper, collate_fn) for ``use_sequence_packing: false``.

    Use as ``StatefulDataLoader(wrapper, batch_sampler=sampler, collate_fn=collator, ...)``.
    Lengths come from ``dataset.lengths`` (else from each example), loss counts from
    ``dataset.loss_token_counts`` when present (counting targets after the first token).
    As in packed mode: ``total_steps`` ends the run after that many steps, ``eval_mode`` reads
    the examples in sequential order (one full epoch, whatever ``total_steps``), and
    ``base_sampler`` replaces the configured base order.
    """
    lengths = getattr(dataset, "lengths", None)
    if lengths is None:
        lengths = [len(dataset[i]["input_ids"]) for i in range(len(dataset))]
    loss_counts = getattr(dataset, "loss_token_counts", None)
    if base_sampler is None:
        kind = "sequential" if eval_mode else getattr(config, "base_order", "random")
        base_sampler = make_base_order(kind, len(dataset), seed)
    sampler = TokenBudgetBatchSampler(
        base_sampler,
        np.asarray(lengths),
        config.global_batch_size,
        dp_size,
        dp_rank=dp_rank,
        max_tokens_per_microbatch=config.max_tokens_per_microbatch,
        micro_batch_size=config.micro_batch_size,
        loss_token_counts=None if loss_counts is None else np.asarray(loss_counts),
        total_steps=total_steps,
        seed=seed,
        eval_mode=eval_mode,
    )
    collator = PaddedCollator(pad_token_id=getattr(config, "pad_token_id", 0))
    return sampler, PlannedDataset(dataset), collator
