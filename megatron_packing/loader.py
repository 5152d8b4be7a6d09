"""`build_sft_dataloader`: dataset + `PackingConfig` -> a resumable torchdata `StatefulDataLoader`.

Packed mode (``use_sequence_packing: true``) plans steps with `DPAlignedPackingBatchSampler`
(varying the batch size only when ``align_packing_bins_to_dp: true``), fetches each rank's own
examples with the plan attached, and collates them into `PackedBatch` objects. The loader's
``state_dict()`` holds the sampler's cursor and carry buffer, so a resume is exact, also into a
loader with another ``num_workers``; a state from another setup, or an empty one, is refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torchdata.stateful_dataloader import StatefulDataLoader

from megatron_packing.base_order import make_base_order
from megatron_packing.config import PackingConfig
from megatron_packing.fetch import PlannedDataset
from megatron_packing.loader_state import sampler_state, saved_worker_count, stream_position
from megatron_packing.packed.collate import PackedCollator
from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler


class PackingDataLoader(StatefulDataLoader):
    """A `StatefulDataLoader` that refuses a wrong state and loads one saved with other workers.

    Everything that decides the stream lives in the batch sampler's state (its iterators own
    their cursor; see `step_stream`); the dataset is map-style and keeps no state. So a state
    saved with the same ``num_workers`` goes through torchdata's own restore, and one saved with
    another ``num_workers`` is reduced to the sampler's position and loaded there.
    """

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state from `state_dict`, also one saved with another ``num_workers``.

        An empty or missing state is refused: torchdata would silently start from step 0.
        """
        if not isinstance(state_dict, dict) or not state_dict:
            raise ValueError(
                f"load_state_dict got {state_dict!r:.60}, not a loader state: pass the dict "
                "that loader.state_dict() returned (saved in the checkpoint); to start from "
                "the beginning, do not load a state at all"
            )
        check = getattr(self.batch_sampler, "check_state", None)
        if callable(check):  # refuse a wrong state now, not at the first iteration
            check(sampler_state(state_dict))
        if saved_worker_count(state_dict) == self.num_workers:
            super().load_state_dict(state_dict)
            return
        position = stream_position(state_dict, self.batch_sampler)
        self.batch_sampler.load_state_dict(position.sampler_state)
        super().load_state_dict({})  # no loader-level state: the next iter() starts fresh
        self.next_iter_state = None  # from the sampler's position


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


def truncated_loss_counts(dataset: Any, sampler: DPAlignedPackingBatchSampler,
                          counts: np.ndarray) -> np.ndarray:
    """Loss-token counts after the ``truncate`` oversize policy cut some examples short."""
    cut = np.nonzero(sampler.effective_lengths < sampler.lengths)[0]
    if cut.size == 0:
        return counts
    counts = counts.copy()
    for index in cut:
        keep = int(sampler.effective_lengths[index])
        mask = dataset[int(index)].get("loss_mask")
        counts[index] = keep - 1 if mask is None else int(np.asarray(mask)[1:keep].sum())
    return counts


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
    """The packed-mode batch sampler for a dataset, as `build_sft_dataloader` makes it."""
    check_not_empty(dataset)
    lengths, counts = example_lengths(dataset)
    if base_sampler is None:
        kind = "sequential" if eval_mode else config.base_order
        base_sampler = make_base_order(kind, len(lengths), config.seed if seed is None else seed)
    sampler = DPAlignedPackingBatchSampler(
        base_sampler,
        lengths,
        config.global_batch_size,
        dp_size,
        bin_capacity=config.bin_capacity,
        allowed_variation=config.packing_batch_size_allowed_variation,
        tp_size=config.tp_size,
        cp_size=config.cp_size,
        fp8_enabled=config.fp8_enabled,
        fp8_recipe=config.fp8_recipe,
        total_steps=total_steps,
        dp_rank=dp_rank,
        algorithm=config.packing_algorithm,
        oversize_policy=config.oversize_policy,
        loss_token_counts=counts,
        rank_assignment=config.rank_assignment,
        attention_cost_constant=config.attention_cost_constant,
        align_to_dp=config.align_packing_bins_to_dp,
        eval_mode=eval_mode,
        lookahead_steps=config.lookahead_steps,
        max_deferred_examples=config.max_deferred_examples,
        seed=config.seed if seed is None else seed,
    )
    if config.oversize_policy == "truncate":
        sampler.loss_token_counts = truncated_loss_counts(dataset, sampler, counts)
    return sampler


def build_sft_dataloader(
    dataset: Any,
    config: PackingConfig,
    *,
    dp_rank: int,
    dp_size: int,
    seed: int | None = None,
    total_steps: int | None = None,
    num_workers: int = 0,
    persistent_workers: bool = False,
    prefetch_factor: int | None = None,
    eval_mode: bool = False,
    base_sampler: Any = None,
    pin_memory: bool = False,
    multiprocessing_context: Any = None,
) -> StatefulDataLoader:
    """A `StatefulDataLoader` yielding this rank's batches, one optimizer step per item.

    Packed mode yields `PackedBatch` (one micro-batch per bin, equal counts on every rank).
    Padded mode (``use_sequence_packing: false``) yields padded micro-batches filled up to
    ``max_tokens_per_microbatch`` tokens, or of ``micro_batch_size`` examples when unset.
    ``total_steps`` is the run's horizon: the last scheduled step repays the batch-size drift.
    """
    config.validate(dp_size)
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
    check_not_empty(dataset)
    if base_sampler is not None and not hasattr(base_sampler, "__len__"):
        raise ValueError(
            f"base_sampler {type(base_sampler).__name__} has no __len__: the packing sampler "
            "needs the epoch length to plan steps and the epoch's last step"
        )
    if config.use_sequence_packing:
        batch_sampler = build_packing_sampler(
            dataset, config, dp_rank=dp_rank, dp_size=dp_size, seed=seed,
            total_steps=total_steps, eval_mode=eval_mode, base_sampler=base_sampler,
        )
        fetch_dataset: Any = PlannedDataset(dataset)
        collate_fn: Any = PackedCollator(
            batch_sampler.alignment, config.bin_capacity,
            pad_token_id=config.pad_token_id, pad_bins_to_capacity=config.pad_bins_to_capacity,
        )
    else:
        from megatron_packing.padded.components import build_padded_components

        batch_sampler, fetch_dataset, collate_fn = build_padded_components(
            dataset, config, dp_rank=dp_rank, dp_size=dp_size,
            seed=config.seed if seed is None else seed,
            total_steps=total_steps, eval_mode=eval_mode, base_sampler=base_sampler,
        )
        if fetch_dataset is None:
            fetch_dataset = dataset
    options: dict[str, Any] = {}
    if num_workers > 0:
        options["persistent_workers"] = persistent_workers
        if prefetch_factor is not None:
            options["prefetch_factor"] = prefetch_factor
        if multiprocessing_context is not None:
            options["multiprocessing_context"] = multiprocessing_context
    return PackingDataLoader(
        fetch_dataset,
        batch_sampler=batch_sampler,
        collate_fn=collate_fn,
        num_workers=num_workers,
        pin_memory=pin_memory,
        **options,
    )
