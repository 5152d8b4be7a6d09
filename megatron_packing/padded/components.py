"""The padded mode's loader parts, built from a `PackingConfig`: sampler, fetch wrapper, collator."""

from __future__ import annotations

from typing import Any

import numpy as np

from megatron_packing.config import PackingConfig
from megatron_packing.padded.collate import PaddedCollator
from megatron_packing.padded.sampler import PaddedSamplerConfig, TokenBudgetBatchSampler
from megatron_packing.stream.base_order import make_base_order
from megatron_packing.stream.fetch import PlannedDataset, check_loss_targets
from megatron_packing.stream.state_checks import target_fingerprint


def build_padded_components(
    dataset: Any,
    config: PackingConfig,
    *,
    dp_rank: int,
    dp_size: int,
    seed: int | None = None,
    total_steps: int | None = None,
    eval_mode: bool = False,
    base_sampler: Any = None,
) -> tuple[TokenBudgetBatchSampler, PlannedDataset, PaddedCollator]:
    """(batch_sampler, dataset_wrapper, collate_fn) for ``use_sequence_packing: false``.

    Use as ``StatefulDataLoader(wrapper, batch_sampler=sampler, collate_fn=collator, ...)``.
    Lengths come from ``dataset.lengths`` (else from each example), loss counts from
    ``dataset.loss_token_counts`` when present (counting targets after the first token).
    As in packed mode: ``seed`` (None: the config's) orders the examples, ``total_steps`` ends
    the run after that many steps, ``eval_mode`` reads the examples in sequential order (one
    full epoch, whatever ``total_steps``), and ``base_sampler`` replaces the configured order.
    """
    lengths = getattr(dataset, "lengths", None)
    loss_counts = getattr(dataset, "loss_token_counts", None)
    if lengths is None or loss_counts is None:  # no index: read every example once
        examples = [dataset[i] for i in range(len(dataset))]
        if lengths is None:
            lengths = [len(example["input_ids"]) for example in examples]
        targets = [len(example["input_ids"]) - 1 if example.get("loss_mask") is None
                   else int(np.count_nonzero(np.asarray(example["loss_mask"])[1:]))
                   for example in examples]
        counts = np.asarray(targets, dtype=np.int64) if loss_counts is None else loss_counts
    else:
        counts = loss_counts
    check_loss_targets(dataset, counts)
    settings = PaddedSamplerConfig(global_batch_size=config.planner.batch_size, dp_size=dp_size,
                                   padded=config.padded,
                                   seed=config.loader.seed if seed is None else seed,
                                   eval_mode=eval_mode)
    if base_sampler is None:
        base_sampler = make_base_order(config.loader.order_kind(eval_mode), len(dataset),
                                       settings.seed)
    sampler = settings.build(base_sampler, np.asarray(lengths), dp_rank=dp_rank,
                             total_steps=total_steps,
                             loss_token_counts=None if loss_counts is None
                             else np.asarray(loss_counts),
                             targets=target_fingerprint(dataset, counts))
    collator = PaddedCollator(pad_token_id=config.collator.pad_token_id)
    return sampler, PlannedDataset(dataset), collator
