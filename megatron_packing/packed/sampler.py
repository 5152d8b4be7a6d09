"""`DPAlignedPackingBatchSampler`: one packed, DP-aligned step at a time, resumable exactly.

Each step takes the next contiguous run of the epoch's base order. Its size varies within
``[B - v, B + v]`` (v = floor(B x variation)) so that its bin count divides by the data-parallel
size; the running drift ``emitted - steps x B`` stays within +-v, the epoch's last step takes
what remains, and the run's final scheduled step (``total_steps``) repays the drift exactly.

Examples read ahead but not yet emitted wait in a carry buffer, which is part of the saved state.
Every rank computes the same plan from the same lengths and seed; nothing is communicated.
"""

from __future__ import annotations

import hashlib
import math
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron_packing.base_order import EpochOrder
from megatron_packing.packing.alignment import make_alignment
from megatron_packing.packing.balance import (
    DEFAULT_ATTENTION_COST_CONSTANT,
    assign_bins_to_ranks,
    bin_costs,
    imbalance,
)
from megatron_packing.packing.factory import make_seq_packer
from megatron_packing.packing.step_sizing import StepContext, StepSizer
from megatron_packing.plan_types import StepPlan
from megatron_packing.state_checks import check_fingerprint, check_state_keys
from megatron_packing.step_stream import OrderPosition, StepStream
from megatron_packing.validation import check_batch_window

STATE_FORMAT_VERSION = 1
STATE_KEYS = ("version", "fingerprint", "order", "carry", "step", "step_in_epoch", "drift")


@dataclass(frozen=True)
class PlannedBatch(Sequence[int]):
    """One step's example indices (a rank's, or the whole global batch) with the step's plan.

    Behaves as a read-only sequence of dataset indices, which is what a DataLoader hands to the
    dataset's ``__getitems__``; the plan travels with it, also to loader worker processes.
    """

    indices: tuple[int, ...]
    plan: StepPlan
    dp_rank: int | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "indices", tuple(int(i) for i in self.indices))

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, position):  # type: ignore[override]
        return self.indices[position]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)


@dataclass
class PackedCursor:
    """Where one iterator stands in the packed stream (what `state_dict` saves)."""

    order: OrderPosition
    carry: list[int] = field(default_factory=list)  # read from the order, not yet emitted
    deferred: int = 0  # the carry's first examples, left by the last step: they lead the next
    step: int = 0  # steps emitted since the start of the run
    step_in_epoch: int = 0
    drift: int = 0  # emitted - steps x B within the epoch
    warned_hopeless: bool = False


class DPAlignedPackingBatchSampler(StepStream[PackedCursor, PlannedBatch]):
    """A stateful batch sampler that plans packed, DP-aligned steps (see the module docstring).

    Args:
        sampler: the base order (sequential, seeded random, or any sampler with ``len``).
        lengths: token length of every example, indexed by dataset index.
        batch_size: B, examples per step on average.
        dp_size: data-parallel size.
        bin_capacity: tokens per packed row.
        allowed_variation: v = floor(B x allowed_variation), the batch-size window.
        total_steps: the run's scheduled steps; the drift is repaid by the last one.
        dp_rank: yield this rank's examples; None yields the global batch.
        align_to_dp: False keeps every step at B and pads the bin count to a multiple of dp.
        eval_mode: a fixed batch size, never varied, for evaluation.
        loss_token_counts: per example tokens trained on, so the plan knows the loss divisor.
        lookahead_steps: steps planned together: among sizes that align this step, prefer
            those after which most of the next steps can align (1 = greedy).
        max_packs: packer runs allowed per step in the search on large windows (small windows
            are searched whole anyway); None searches the whole window always.
        max_deferred_examples: a step that cannot align may leave up to this many examples of
            its window to lead the next step (0: never). No example moves by more than one step.
        seed: seeds the epochs of a random base sampler that has no generator of its own.
    """

    def __init__(
        self,
        sampler: Iterable[int],
        lengths: Sequence[int] | np.ndarray,
        batch_size: int,
        dp_size: int,
        *,
        bin_capacity: int,
        allowed_variation: float = 0.05,
        tp_size: int = 1,
        cp_size: int = 1,
        fp8_enabled: bool = False,
        fp8_recipe: str | None = None,
        total_steps: int | None = None,
        dp_rank: int | None = None,
        algorithm: str = "mffd",
        oversize_policy: str = "error",
        loss_token_counts: Sequence[int] | np.ndarray | None = None,
        rank_assignment: str = "karmarkar_karp",
        attention_cost_constant: float = DEFAULT_ATTENTION_COST_CONSTANT,
        align_to_dp: bool = True,
        eval_mode: bool = False,
        lookahead_steps: int = 3,
        max_packs: int | None = 8,
        max_deferred_examples: int = 0,
        seed: int = 0,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
            raise ValueError(f"dp_size must be an integer >= 1, got {dp_size!r}")
        if dp_rank is not None and not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank!r}")
        if total_steps is not None and (not isinstance(total_steps, int) or total_steps < 1):
            raise ValueError(f"total_steps must be a positive integer or None, got {total_steps!r}")
        self.base_sampler = sampler
        self.seed = seed
        self.order = EpochOrder(sampler, seed=seed)  # the order's length and fingerprint
        self.lengths = _as_lengths(lengths)
        if len(self.order) > len(self.lengths):
            raise ValueError(
                f"the base sampler covers {len(self.order)} examples but only "
                f"{len(self.lengths)} lengths were given"
            )
        if len(self.order) == 0:
            raise ValueError(
                "the dataset has 0 examples (the base sampler covers none): there is nothing to "
                "plan; check the data sources (an empty file, or every record skipped)"
            )
        self.batch_size = batch_size
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.bin_capacity = int(bin_capacity)
        self.total_steps = total_steps
        self.eval_mode = eval_mode
        self.align_to_dp = align_to_dp and not eval_mode
        self.variation_fraction = float(allowed_variation)
        if self.align_to_dp:
            # B - v >= dp is a config rule (every rank gets real work); the sampler itself also
            # serves smaller batches, giving ranks placeholder rows.
            self.variation = check_batch_window(batch_size, allowed_variation, None)
        else:
            self.variation = 0
        self.alignment = make_alignment(tp_size, cp_size, fp8_enabled, fp8_recipe)
        self.packer = make_seq_packer(
            algorithm, bin_capacity=self.bin_capacity, alignment=self.alignment,
            oversize_policy=oversize_policy,
        )
        self.effective_lengths = np.asarray(self.packer.effective_lengths(self.lengths), dtype=np.int64)
        self.aligned_lengths = self.alignment.aligned_lengths(self.effective_lengths)
        if loss_token_counts is not None:
            counts = np.asarray(loss_token_counts, dtype=np.int64)
            if counts.shape != self.lengths.shape:
                raise ValueError(
                    f"loss_token_counts has {counts.shape[0] if counts.ndim else 0} entries, "
                    f"lengths has {len(self.lengths)}"
                )
            self.loss_token_counts: np.ndarray | None = counts
        else:
            self.loss_token_counts = None
        self.rank_assignment = rank_assignment
        self.attention_cost_constant = float(attention_cost_constant)
        if isinstance(lookahead_steps, bool) or not isinstance(lookahead_steps, int) or lookahead_steps < 1:
            raise ValueError(f"lookahead_steps must be an integer >= 1, got {lookahead_steps!r}")
        if (isinstance(max_deferred_examples, bool) or not isinstance(max_deferred_examples, int)
                or max_deferred_examples < 0):
            raise ValueError(
                f"max_deferred_examples must be an integer >= 0, got {max_deferred_examples!r}")
        self.max_deferred_examples = max_deferred_examples if self.align_to_dp else 0
        self.sizer = StepSizer(self.packer, dp_size, max_packs=max_packs, horizon=lookahead_steps,
                               max_deferred=self.max_deferred_examples)
        self.lookahead_steps = lookahead_steps
        self._fingerprint = self._make_fingerprint(algorithm, oversize_policy, tp_size, cp_size,
                                                   fp8_enabled, fp8_recipe, max_packs)
        self._fingerprint.update(self.order.fingerprint())
        self._init_stream()

    # ------------------------------------------------------------------ sizes
    @property
    def num_examples(self) -> int:
        return len(self.order)

    @property
    def steps_per_epoch(self) -> int:
        return max(1, math.ceil(self.num_examples / self.batch_size)) if self.num_examples else 0

    @property
    def epoch(self) -> int:
        return self._position().order.epoch

    @property
    def step(self) -> int:
        """Steps emitted since the start of the run."""
        return self._position().step

    def __len__(self) -> int:
        return self.steps_per_epoch

    # ------------------------------------------------------------------ epochs
    def _epoch_complete(self, cursor: PackedCursor) -> bool:
        return cursor.step_in_epoch >= self.steps_per_epoch

    def _start_epoch(self, cursor: PackedCursor, epoch: int) -> None:
        cursor.order.start_epoch(epoch)
        cursor.carry = []
        cursor.deferred = 0
        cursor.step_in_epoch = 0
        cursor.drift = 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch, as with DistributedSampler. Only allowed between epochs."""
        epoch = int(epoch)
        cursor = self._position()
        if epoch == cursor.order.epoch:
            return
        if cursor.step_in_epoch not in (0, self.steps_per_epoch):
            raise ValueError(
                f"set_epoch({epoch}) in the middle of epoch {cursor.order.epoch} (step "
                f"{cursor.step_in_epoch} of {self.steps_per_epoch}); call it between epochs"
            )
        self._start_epoch(cursor, epoch)
        self._position_changed()

    # ------------------------------------------------------------------ iteration
    def _new_cursor(self) -> PackedCursor:
        return PackedCursor(OrderPosition(EpochOrder(self.base_sampler, seed=self.seed)))

    def _begin(self, cursor: PackedCursor) -> None:
        if self._epoch_complete(cursor):
            self._start_epoch(cursor, cursor.order.epoch + 1)

    def _next_step(self, cursor: PackedCursor) -> PlannedBatch | None:
        if self._epoch_complete(cursor):
            return None
        if self.total_steps is not None and cursor.step >= self.total_steps and not self.eval_mode:
            return None
        plan = self._plan_step(cursor)
        if self.dp_rank is None:
            return PlannedBatch(plan.example_indices, plan, None)
        return PlannedBatch(tuple(plan.examples_of_rank(self.dp_rank)), plan, self.dp_rank)

    def _context(self, cursor: PackedCursor) -> StepContext:
        steps_left_in_run = None
        if self.total_steps is not None and not self.eval_mode:
            steps_left_in_run = self.total_steps - cursor.step
        return StepContext(
            batch_size=self.batch_size,
            variation=self.variation,
            drift=cursor.drift,
            remaining=cursor.order.remaining + len(cursor.carry),
            steps_left_in_epoch=self.steps_per_epoch - cursor.step_in_epoch,
            steps_left_in_run=steps_left_in_run,
        )

    def _plan_step(self, cursor: PackedCursor) -> StepPlan:
        started = time.perf_counter()
        context = self._context(cursor)
        need = min(context.remaining,
                   context.lookahead_need(self.lookahead_steps) + self.max_deferred_examples)
        if len(cursor.carry) < need:
            cursor.carry.extend(cursor.order.take(need - len(cursor.carry)))
        ahead = np.asarray(cursor.carry[:need], dtype=np.int64)
        if ahead.size and (ahead.min() < 0 or ahead.max() >= len(self.lengths)):
            bad = int(ahead[(ahead < 0) | (ahead >= len(self.lengths))][0])
            raise IndexError(f"the base sampler yielded index {bad}, outside [0, {len(self.lengths)})")
        decision = self.sizer.decide(self.effective_lengths[ahead], self.aligned_lengths[ahead], context,
                                     forced=cursor.deferred)
        if decision.hopeless and not cursor.warned_hopeless:
            cursor.warned_hopeless = True
            warnings.warn(
                f"a step of about {self.batch_size} examples packs into fewer bins than the "
                f"data-parallel size {self.dp_size} at capacity {self.bin_capacity}: alignment "
                "cannot succeed, so the search is skipped and such steps are padded (reported as "
                "train/padding_bins)",
                stacklevel=3,
            )
        size, span = decision.size, decision.span
        window = ahead[:span]
        if decision.deferred:
            keep = np.ones(span, dtype=bool)
            keep[decision.deferred] = False
            taken = window[keep]
        else:
            taken = window
        step_lengths = self.effective_lengths[taken]
        costs = bin_costs(decision.bins, self.effective_lengths[window], self.attention_cost_constant)
        assignment = assign_bins_to_ranks(costs, self.dp_size, method=self.rank_assignment)
        taken_list = taken.tolist()
        window_list = window.tolist()
        bins = tuple(tuple(window_list[p] for p in b) for b in decision.bins)
        truncated = {
            int(i): int(self.effective_lengths[i])
            for i in taken[step_lengths < self.lengths[taken]]
        }
        num_tokens = int(step_lengths.sum())
        num_loss = None if self.loss_token_counts is None else int(self.loss_token_counts[taken].sum())

        cursor.carry = [window_list[p] for p in decision.deferred] + cursor.carry[span:]
        cursor.deferred = len(decision.deferred)
        cursor.drift += size - self.batch_size
        plan = StepPlan(
            step=cursor.step,
            epoch=cursor.order.epoch,
            step_in_epoch=cursor.step_in_epoch,
            dp_size=self.dp_size,
            bin_capacity=self.bin_capacity,
            example_indices=tuple(taken_list),
            bins=bins,
            rank_bins=tuple(tuple(int(b) for b in rank) for rank in assignment),  # few: cheap
            truncated=truncated,
            num_tokens=num_tokens,
            num_loss_tokens=num_loss,
            packed_bins=decision.packed_bins,
            padding_bins=decision.padding_bins,
            placeholder_bins=decision.placeholder_bins,
            aligned=decision.aligned,
            hopeless=decision.hopeless,
            token_fill=num_tokens / (len(bins) * self.bin_capacity) if bins else 0.0,
            dp_imbalance=float(imbalance(costs, assignment)),
            plan_ms=0.0,
            drift=cursor.drift,
            is_eval=self.eval_mode,
            packs=decision.packs,
            packer_runs=decision.packer_runs,
            deferred=tuple(window_list[p] for p in decision.deferred),
        )
        cursor.step += 1
        cursor.step_in_epoch += 1
        if self._epoch_complete(cursor):
            cursor.drift = 0
        object.__setattr__(plan, "plan_ms", (time.perf_counter() - started) * 1e3)
        return plan

    # ------------------------------------------------------------------ state
    def _make_fingerprint(self, algorithm: str, oversize_policy: str, tp: int, cp: int,
                          fp8: bool, recipe: str | None, max_packs: int) -> dict[str, Any]:
        digest = hashlib.sha256(np.ascontiguousarray(self.lengths, dtype=np.int64).tobytes()).hexdigest()
        return {
            "lengths_sha256": digest[:24],
            "num_examples": self.num_examples,
            "batch_size": self.batch_size,
            "allowed_variation": self.variation,
            "dp_size": self.dp_size,
            "bin_capacity": self.bin_capacity,
            "alignment": [self.alignment.seq_multiple, self.alignment.bin_multiple],
            "tp_cp_fp8": [tp, cp, bool(fp8), recipe],
            "algorithm": str(getattr(algorithm, "value", algorithm)),
            "oversize_policy": str(getattr(oversize_policy, "value", oversize_policy)),
            "align_to_dp": self.align_to_dp,
            "eval_mode": self.eval_mode,
            "lookahead_steps": self.lookahead_steps,
            "max_packs": max_packs,
            "rank_assignment": self.rank_assignment,
            "attention_cost_constant": self.attention_cost_constant,
            "max_deferred_examples": self.max_deferred_examples,
        }

    def _cursor_state(self, cursor: PackedCursor) -> dict[str, Any]:
        return {
            "version": STATE_FORMAT_VERSION,
            "fingerprint": dict(self._fingerprint),
            "order": cursor.order.state_dict(),
            "carry": list(cursor.carry),
            "deferred": cursor.deferred,
            "step": cursor.step,
            "step_in_epoch": cursor.step_in_epoch,
            "drift": cursor.drift,
            "warned_hopeless": cursor.warned_hopeless,
        }

    def _cursor_from_state(self, state: dict[str, Any]) -> PackedCursor:
        return PackedCursor(
            order=OrderPosition(EpochOrder(self.base_sampler, seed=self.seed), state["order"]),
            carry=[int(i) for i in state["carry"]],
            deferred=int(state.get("deferred", 0)),
            step=int(state["step"]),
            step_in_epoch=int(state["step_in_epoch"]),
            drift=int(state["drift"]),
            warned_hopeless=bool(state.get("warned_hopeless", False)),
        )

    def check_state(self, state: Any) -> None:
        """Raise unless ``state`` is a complete state of this sampler's setup (loads nothing)."""
        check_state_keys(state, STATE_KEYS, "DPAlignedPackingBatchSampler")
        version = state.get("version")
        if version != STATE_FORMAT_VERSION:
            raise ValueError(
                f"sampler state has format version {version!r}; this build reads version "
                f"{STATE_FORMAT_VERSION}"
            )
        check_fingerprint(state["fingerprint"], self._fingerprint)


def _as_lengths(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    array = np.asarray(lengths)
    if array.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"lengths must be integers, got dtype {array.dtype}")
    if array.size and array.min() <= 0:
        position = int(np.argmin(array))
        raise ValueError(f"lengths must be positive: example {position} has length {int(array[position])}")
    return array.astype(np.int64, copy=False)


__all__ = [
    "DPAlignedPackingBatchSampler",
    "PlannedBatch",
]
