"""A step's plan for examples that come without one: what `PackedCollator` packs on its own.

With the stateful sampler, each step is planned ahead (its size chosen so the bins divide by dp)
and the collator only writes rows. A user with a sampler of their own (Megatron's, a plain batch
sampler, a curriculum) hands the collator a list of examples instead: this module plans that one
step with the same parts, once, as given. `make_sft_sequence_packer` packs the lengths (the
capacity, the TP / CP / FP8 alignment, the oversize policy, the algorithm) and, with a dp size,
rounds the bin count up to a multiple of dp with empty bins, which become zero-loss placeholder
rows; the sampler's hand-out gives every rank as many bins, of even cost; `RowPlanner` lays out
the rows. The examples are not reordered or dropped; the batch size is what was given.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from megatron_packing.common.plan_types import StepPlan
from megatron_packing.config.components import PackerConfig, PlannerConfig
from megatron_packing.packed.layout import RowPlanner
from megatron_packing.packing.algorithms import SeqPacker
from megatron_packing.packing.balance import bin_costs, imbalance
from megatron_packing.packing.factory import make_sft_sequence_packer
from megatron_packing.packing.hand_out import hand_out
from megatron_packing.packing.tunables import DEFAULT_TUNABLES


def plan_given_step(lengths: Sequence[int], loss_token_counts: Sequence[int] | None, *,
                    packer: PackerConfig, planner: PlannerConfig, dp_size: int = 1) -> StepPlan:
    """The plan of one step of exactly these examples (positions 0..n-1 stand for them)."""
    started = time.perf_counter()
    given = np.asarray(lengths, dtype=np.int64)

    def packer_for(dp: int | None) -> SeqPacker:
        return make_sft_sequence_packer(
            packer.bin_capacity, packer.tp_size, packer.cp_size, dp_size=dp,
            fp8_enabled=packer.fp8_enabled, fp8_recipe=packer.fp8_recipe,
            algorithm=packer.algorithm, oversize_policy=packer.oversize_policy)

    seq_packer = packer_for(dp_size)
    kept = np.asarray(seq_packer.effective_lengths(given), dtype=np.int64)
    padded = packer.alignment.padded_lengths(kept)
    packed = seq_packer.pack(given)
    natural = len(packer_for(None).pack(given)) if dp_size > 1 else len(packed)
    bins, ranks = hand_out(packed, kept, padded, dp_size, seq_packer.usable_capacity,
                           planner.rank_assignment, DEFAULT_TUNABLES,
                           planner.attention_cost_constant, planner.microbatch_cost_tokens)
    layouts = RowPlanner(packer.alignment, packer.bin_capacity,
                         pad_to_capacity=packer.pad_bins_to_capacity).rows(
        bins, kept.tolist(), padded.tolist())
    costs = bin_costs(bins, kept, planner.attention_cost_constant,
                      planner.microbatch_cost_tokens)
    num_tokens = int(kept.sum())
    placeholders = sum(1 for b in bins if not b)
    return StepPlan(
        step=0, epoch=0, step_in_epoch=0, dp_size=dp_size, bin_capacity=packer.bin_capacity,
        example_indices=tuple(range(len(given))),
        bins=tuple(tuple(int(p) for p in b) for b in bins),
        layouts=layouts,
        rank_bins=tuple(tuple(int(b) for b in rank) for rank in ranks),
        truncated={int(i): int(kept[i]) for i in np.nonzero(kept < given)[0]},
        num_tokens=num_tokens,
        num_loss_tokens=None if loss_token_counts is None else int(np.sum(loss_token_counts)),
        packed_bins=natural,
        padding_bins=len(bins) - natural,
        placeholder_bins=placeholders,
        aligned=len(bins) == natural,
        hopeless=False,
        token_fill=num_tokens / (len(bins) * packer.bin_capacity) if bins else 0.0,
        dp_imbalance=float(imbalance(costs, ranks)),
        plan_ms=(time.perf_counter() - started) * 1e3,
        drift=0,
    )


__all__ = ["plan_given_step"]
