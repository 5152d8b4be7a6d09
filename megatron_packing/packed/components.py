"""The packed mode's loader parts, built from a `PackingConfig`: sampler, fetch wrapper, collator."""

from __future__ import annotations

from typing import Any

import numpy as np

from megatron_packing.config import PackerConfig, PackingConfig
from megatron_packing.packed.collate import PackedCollator
from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler, PackedSamplerConfig
from megatron_packing.stream.base_order import make_base_order
from megatron_packing.stream.fetch import PlannedDataset, check_loss_targets
from megatron_packing.stream.state_checks import target_fingerprint


def check_not_empty(dataset: Any) -> None:
    """An empty dataset (or one whose every record was skipped) cannot train: say so at once."""
    if len(dataset) > 0:
        return
    skipped = dict(getattr(dataset, "skipped", None) or {})
    if skipped:
        reasons = ", ".join(f"{reason}={count}" for reason, count in sorted(skipped.items()))
        raise ValueError(
            f"the dataset has 0 examples ({sum(skipped.values())} skipped: {reasons}): nothing "
            "to train on; every record was skipped as bad (load with on_bad_record='error' to "
            "see the first one and why)"
        )
    raise ValueError("the dataset has 0 examples: nothing to train on; check the data sources "
                     "(an empty file, or a selection that matched nothing)")


def example_lengths(dataset: Any) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, loss-token counts) of every example: from the dataset's index when it has one.

    The loss-token count is the number of positions t >= 1 whose mask is set, i.e. the targets a
    next-token loss trains on. Datasets without an index are read once.
    """
    lengths = getattr(dataset, "lengths", None)
    counts = getattr(dataset, "loss_token_counts", None)
    if lengths is not None and counts is not None:
        return np.asarray(lengths, dtype=np.int64), np.asarray(counts, dtype=np.int64)
    lengths_list, counts_list = [], []
    for i in range(len(dataset)):
        example = dataset[i]
        ids = example["input_ids"]
        mask = example.get("loss_mask")
        lengths_list.append(len(ids))
        counts_list.append(len(ids) - 1 if mask is None else int(np.asarray(mask)[1:].sum()))
    return np.asarray(lengths_list, dtype=np.int64), np.asarray(counts_list, dtype=np.int64)


def truncated_loss_counts(dataset: Any, packer: PackerConfig, lengths: np.ndarray,
                          counts: np.ndarray) -> np.ndarray:
    """Loss-token counts after the ``truncate`` oversize policy cuts some examples short (the
    packer's effective lengths), known before the sampler is built."""
    if packer.oversize_policy != "truncate":
        return counts
    kept = np.asarray(packer.build().effective_lengths(lengths), dtype=np.int64)
    cut = np.nonzero(kept < lengths)[0]
    if cut.size == 0:
        return counts
    counts = counts.copy()
    for index in cut:
        keep = int(kept[index])
        mask = dataset[int(index)].get("loss_mask")
        counts[index] = keep - 1 if mask is None else int(np.asarray(mask)[1:keep].sum())
    return counts


def packed_sampler_config(config: PackingConfig, dp_size: int, *, seed: int | None = None,
                          eval_mode: bool = False) -> PackedSamplerConfig:
    """What the packed sampler plans with; ``seed`` (None: the config's) orders the examples."""
    return PackedSamplerConfig(packer=config.packer, planner=config.planner, dp_size=dp_size,
                               seed=config.loader.seed if seed is None else seed,
                               eval_mode=eval_mode)


def build_packing_sampler(
    dataset: Any,
    config: PackingConfig,
    *,
    dp_rank: int | None,
    dp_size: int,
    seed: int | None = None,
    total_steps: int | None = None,
    eval_mode: bool = False,
    base_sampler: Any = None,
) -> DPAlignedPackingBatchSampler:
    """The packed-mode batch sampler for a dataset, as `build_sft_dataloader` makes it.

    ``seed`` (None: the config's) orders the examples; ``eval_mode`` reads them in sequence with a
    fixed batch size; ``base_sampler`` replaces the configured base order.
    """
    check_not_empty(dataset)
    lengths, counts = example_lengths(dataset)
    check_loss_targets(dataset, counts)
    settings = packed_sampler_config(config, dp_size, seed=seed, eval_mode=eval_mode)
    if base_sampler is None:
        base_sampler = make_base_order(config.loader.order_kind(eval_mode), len(lengths),
                                       settings.seed)
    return settings.build(base_sampler, lengths, dp_rank=dp_rank, total_steps=total_steps,
                          loss_token_counts=truncated_loss_counts(dataset, config.packer,
                                                                  lengths, counts),
                          targets=target_fingerprint(dataset, counts))


def build_packed_components(
    dataset: Any,
    config: PackingConfig,
    *,
    dp_rank: int,
    dp_size: int,
    seed: int | None = None,
    total_steps: int | None = None,
    eval_mode: bool = False,
    base_sampler: Any = None,
) -> tuple[DPAlignedPackingBatchSampler, PlannedDataset, PackedCollator]:
    """(batch_sampler, dataset_wrapper, collate_fn) for ``use_sequence_packing: true``.

    Use as ``StatefulDataLoader(wrapper, batch_sampler=sampler, collate_fn=collator, ...)``; the
    keywords are `build_packing_sampler`'s.
    """
    sampler = build_packing_sampler(dataset, config, dp_rank=dp_rank, dp_size=dp_size, seed=seed,
                                    total_steps=total_steps, eval_mode=eval_mode,
                                    base_sampler=base_sampler)
    collator = PackedCollator(pad_token_id=config.collator.pad_token_id)
    return sampler, PlannedDataset(dataset), collator


__all__ = [
    "build_packed_components",
    "build_packing_sampler",
    "check_not_empty",
    "example_lengths",
    "packed_sampler_config",
    "truncated_loss_counts",
]
