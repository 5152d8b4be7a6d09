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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from megatron_packing.common.config_fields import (
    check_field,
    check_seed,
    require_component,
    split_settings,
)
from megatron_packing.common.plan_types import StepPlan, TupleSequence
from megatron_packing.common.validation import require_bool, require_int, require_positive_int
from megatron_packing.config.components import PackerConfig, PlannerConfig
from megatron_packing.packed.layout import RowPlanner
from megatron_packing.packing.balance import (
    bin_costs,
    imbalance,
)
from megatron_packing.packing.hand_out import hand_out
from megatron_packing.packing.planner.feasibility import alignment_remedy
from megatron_packing.packing.planner.window import StepContext
from megatron_packing.stream.base_order import EpochOrder
from megatron_packing.stream.state_checks import (
    check_fingerprint,
    check_state_fields,
    check_state_keys,
)
from megatron_packing.stream.step_stream import OrderPosition, StepStream

STATE_FORMAT_VERSION = 1
STATE_KEYS = ("version", "fingerprint", "order", "carry", "deferred", "step", "step_in_epoch",
              "drift", "warned_hopeless")
STATE_RULES = {"version": ("int", 1), "fingerprint": ("dict", None), "order": ("dict", None),
               "carry": ("int_list", 0), "deferred": ("int", 0), "step": ("int", 0),
               "step_in_epoch": ("int", 0), "drift": ("int", None),
               "warned_hopeless": ("bool", None)}
"""Each state field's type and range (`check_state_fields`)."""


@dataclass(frozen=True)
class PlannedBatch(TupleSequence):
    """One step's example indices (a rank's, or the whole global batch) with the step's plan.

    Behaves as a read-only sequence of dataset indices, which is what a DataLoader hands to the
    dataset's ``__getitems__``; the plan travels with it, also to loader worker processes.
    """

    indices: tuple[int, ...]
    plan: StepPlan
    dp_rank: int | None

    def __post_init__(self) -> None:
        if not isinstance(self.indices, tuple):  # the sampler passes tuples of ints already
            object.__setattr__(self, "indices", tuple(int(i) for i in self.indices))



@dataclass(frozen=True)
class PackedSamplerConfig:
    """Everything `DPAlignedPackingBatchSampler` plans with, besides the data and the rank."""

    packer: PackerConfig
    planner: PlannerConfig
    dp_size: int
    seed: int = 0
    """Seeds the epochs of a random base sampler that has no generator of its own."""
    eval_mode: bool = False
    """A fixed batch size, never varied, for evaluation."""

    def __post_init__(self) -> None:
        require_component(self, "packer", PackerConfig)
        require_component(self, "planner", PlannerConfig)
        check_field(self, "dp_size", require_positive_int)
        check_seed(self)
        check_field(self, "eval_mode", require_bool)

    @classmethod
    def from_settings(cls, batch_size: int, dp_size: int, *, owner: str,
                      **settings: Any) -> PackedSamplerConfig:
        """The config of the sampler's keyword form: each flat setting is a field of
        `PackerConfig`, `PlannerConfig` or this config (their defaults apply to the rest)."""
        if "bin_capacity" not in settings:
            raise TypeError(f"{owner} needs the keyword argument 'bin_capacity'")
        packer, planner, mine = split_settings(
            (PackerConfig, PlannerConfig, _Own), settings, owner=owner)
        return cls(packer=PackerConfig(**packer),
                   planner=PlannerConfig(batch_size=batch_size, **planner),
                   dp_size=dp_size, **mine)

    def settings(self) -> dict[str, Any]:
        """The flat settings `from_settings` takes back (B and dp aside)."""
        out = {f.name: getattr(self.packer, f.name) for f in fields(self.packer)}
        out.update({f.name: getattr(self.planner, f.name) for f in fields(self.planner)
                    if f.name != "batch_size"})
        out.update(seed=self.seed, eval_mode=self.eval_mode)
        return out

    def build(self, sampler: Iterable[int], lengths: Sequence[int] | np.ndarray, *,
              dp_rank: int | None = None, total_steps: int | None = None,
              loss_token_counts: Sequence[int] | np.ndarray | None = None,
              targets: Mapping[str, Any] | None = None) -> DPAlignedPackingBatchSampler:
        """The sampler over ``sampler``'s order and ``lengths``, yielding ``dp_rank``'s steps
        (None: the global batch)."""
        return DPAlignedPackingBatchSampler(
            sampler, lengths, self.planner.batch_size, self.dp_size, dp_rank=dp_rank,
            total_steps=total_steps, loss_token_counts=loss_token_counts, targets=targets,
            **self.settings())

    @property
    def align_to_dp(self) -> bool:
        """Alignment in force: evaluation keeps every step at B."""
        return self.planner.align_to_dp and not self.eval_mode

    @property
    def v(self) -> int:
        """v when steps align, else 0."""
        return self.planner.v if self.align_to_dp else 0

    @property
    def max_deferred_examples(self) -> int:
        """The deferral limit in force (only aligned steps defer)."""
        return self.planner.max_deferred_examples if self.align_to_dp else 0


@dataclass(frozen=True)
class _Own:
    """`PackedSamplerConfig`'s own flat settings (for `split_settings`)."""

    seed: int = 0
    eval_mode: bool = False


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
    # ``carry`` as an array, for the list object it was made from (another list: rebuilt).
    # Converting the whole read-ahead each step was a tenth of a step's planning at B = 4096.
    carry_array: tuple[list[int], np.ndarray] | None = field(default=None, repr=False,
                                                                compare=False)


class DPAlignedPackingBatchSampler(StepStream[PackedCursor, PlannedBatch]):
    """A stateful batch sampler that plans packed, DP-aligned steps (see the module docstring).

    Args:
        sampler: the base order (sequential, seeded random, or any sampler with ``len``).
        lengths: token length of every example, indexed by dataset index.
        batch_size: B, examples per step on average.
        dp_size: the data-parallel size.
        dp_rank: yield this rank's examples; None yields the global batch.
        total_steps: the run's scheduled steps; the drift is repaid by the last one.
        loss_token_counts: per example tokens trained on, so the plan knows the loss divisor.
        targets: what decides what is trained on the examples (`state_checks.target_fingerprint`):
            part of the state's fingerprint, so a resume with other loss masks, tokenizer or
            template is refused.
        settings: the packer's, the planner's and the sampler's settings by field name
            (`PackerConfig`, `PlannerConfig`, ``seed``, ``eval_mode``; their defaults apply):
            ``bin_capacity`` (required), ``allowed_variation``, ``tp_size``, ...

    `PackedSamplerConfig.build` makes one from a config.
    """

    def __init__(
        self,
        sampler: Iterable[int],
        lengths: Sequence[int] | np.ndarray,
        batch_size: int,
        dp_size: int,
        *,
        dp_rank: int | None = None,
        total_steps: int | None = None,
        loss_token_counts: Sequence[int] | np.ndarray | None = None,
        targets: Mapping[str, Any] | None = None,
        **settings: Any,
    ) -> None:
        config = PackedSamplerConfig.from_settings(batch_size, dp_size,
                                                   owner="DPAlignedPackingBatchSampler",
                                                   **settings)
        packer, planner = config.packer, config.planner
        self.config = config
        self.dp_rank = require_int("dp_rank", dp_rank, minimum=0, maximum=config.dp_size - 1,
                                   allow_none=True)
        self.total_steps = require_positive_int("total_steps", total_steps, allow_none=True)
        self.base_sampler = sampler
        self.seed = config.seed
        self.order = EpochOrder(sampler, seed=config.seed)  # the order's length and fingerprint
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
        self.batch_size = planner.batch_size
        self.dp_size = config.dp_size
        self.bin_capacity = packer.bin_capacity
        self.eval_mode = config.eval_mode
        # B - v >= dp is a config rule (every rank gets real work); the sampler itself also serves
        # smaller batches, giving ranks placeholder rows.
        self.align_to_dp = config.align_to_dp
        self.variation_fraction = planner.allowed_variation
        self.v = config.v
        self.alignment = packer.alignment
        self.packer = packer.build()  # dp rounding is the planner's (StepSizer)
        self.effective_lengths = np.asarray(self.packer.effective_lengths(self.lengths), dtype=np.int64)
        self.padded_lengths = self.alignment.padded_lengths(self.effective_lengths)
        self.row_planner = RowPlanner(self.alignment, self.bin_capacity,
                                      pad_to_capacity=packer.pad_bins_to_capacity)
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
        self.rank_assignment = planner.rank_assignment
        self.attention_cost_constant = planner.attention_cost_constant
        self.microbatch_cost_tokens = planner.microbatch_cost_tokens
        self.max_deferred_examples = config.max_deferred_examples
        self.lookahead_steps = planner.lookahead_steps
        self.sizer = planner.build(self.packer, self.dp_size,
                                   max_deferred=self.max_deferred_examples)
        self._fingerprint = self._make_fingerprint()
        self._fingerprint.update(self.order.fingerprint())
        self._fingerprint.update(targets or {})
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
            v=self.v,
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
        carry = cursor.carry
        mirror = cursor.carry_array
        array = (mirror[1] if mirror is not None and mirror[0] is carry and len(mirror[1]) == len(carry)
                 else np.asarray(carry, dtype=np.int64))
        if len(carry) < need:
            more = cursor.order.take(need - len(carry))
            carry.extend(more)
            array = np.concatenate((array, np.asarray(more, dtype=np.int64)))
        ahead = array[:need]
        if ahead.size and (ahead.min() < 0 or ahead.max() >= len(self.lengths)):
            bad = int(ahead[(ahead < 0) | (ahead >= len(self.lengths))][0])
            raise IndexError(f"the base sampler yielded index {bad}, outside [0, {len(self.lengths)})")
        decision = self.sizer.decide(self.effective_lengths[ahead], self.padded_lengths[ahead], context,
                                     forced=cursor.deferred)
        if decision.hopeless and not cursor.warned_hopeless:
            cursor.warned_hopeless = True
            remedy = alignment_remedy(self.padded_lengths[ahead], self.packer.usable_capacity,
                                      self.batch_size, self.dp_size)
            warnings.warn(
                f"a step of about {self.batch_size} examples packs into fewer bins than the "
                f"data-parallel size {self.dp_size} at capacity {self.bin_capacity}: alignment "
                "cannot succeed, so the search is skipped and such steps are padded (reported as "
                f"train/padding_bins); on the examples ahead, {remedy.describe()}",
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
        kept, padded = self.effective_lengths[window], self.padded_lengths[window]
        step_bins, assignment = hand_out(
            decision.bins, kept, padded, self.dp_size, self.packer.usable_capacity,
            self.rank_assignment, self.sizer.tunables, self.attention_cost_constant,
            self.microbatch_cost_tokens)
        costs = bin_costs(step_bins, kept, self.attention_cost_constant, self.microbatch_cost_tokens)
        taken_list = taken.tolist()
        window_list = window.tolist()
        bins = tuple(tuple([window_list[p] for p in b]) for b in step_bins)
        layouts = self.row_planner.rows(step_bins, kept.tolist(), padded.tolist())
        truncated = {
            int(i): int(self.effective_lengths[i])
            for i in taken[step_lengths < self.lengths[taken]]
        }
        num_tokens = int(step_lengths.sum())
        num_loss = None if self.loss_token_counts is None else int(self.loss_token_counts[taken].sum())

        cursor.carry = [window_list[p] for p in decision.deferred] + carry[span:]
        cursor.carry_array = (cursor.carry, np.concatenate((window[decision.deferred], array[span:])))
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
            layouts=layouts,
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
            evened=decision.evened,
        )
        cursor.step += 1
        cursor.step_in_epoch += 1
        if self._epoch_complete(cursor):
            cursor.drift = 0
        object.__setattr__(plan, "plan_ms", (time.perf_counter() - started) * 1e3)
        return plan

    # ------------------------------------------------------------------ state
    def _make_fingerprint(self) -> dict[str, Any]:
        packer = self.config.packer
        digest = hashlib.sha256(np.ascontiguousarray(self.lengths, dtype=np.int64).tobytes()).hexdigest()
        return {
            "lengths_sha256": digest[:24],
            "num_examples": self.num_examples,
            "batch_size": self.batch_size,
            "v": self.v,
            "dp_size": self.dp_size,
            "bin_capacity": self.bin_capacity,
            "alignment": [self.alignment.seq_multiple, self.alignment.bin_multiple],
            "tp_cp_fp8": [packer.tp_size, packer.cp_size, packer.fp8_enabled, packer.fp8_recipe],
            "algorithm": packer.algorithm,
            "oversize_policy": packer.oversize_policy,
            "align_to_dp": self.align_to_dp,
            "eval_mode": self.eval_mode,
            "lookahead_steps": self.lookahead_steps,
            "max_packs": self.config.planner.max_packs,
            "rank_assignment": self.rank_assignment,
            "attention_cost_constant": self.attention_cost_constant,
            "microbatch_cost_tokens": self.microbatch_cost_tokens,
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
            deferred=int(state["deferred"]),
            step=int(state["step"]),
            step_in_epoch=int(state["step_in_epoch"]),
            drift=int(state["drift"]),
            warned_hopeless=bool(state["warned_hopeless"]),
        )

    def check_state(self, state: Any) -> None:
        """Raise unless ``state`` is a complete state of this sampler's setup (loads nothing)."""
        check_state_keys(state, STATE_KEYS, "DPAlignedPackingBatchSampler")
        check_state_fields(state, STATE_RULES, "DPAlignedPackingBatchSampler")
        version = state.get("version")
        if version != STATE_FORMAT_VERSION:
            raise ValueError(
                f"sampler state has format version {version!r}; this build reads version "
                f"{STATE_FORMAT_VERSION}"
            )
        check_fingerprint(state["fingerprint"], self._fingerprint)
        beyond = [i for i in state["carry"] if i >= self.num_examples]
        if beyond:
            raise ValueError(f"DPAlignedPackingBatchSampler.load_state_dict got a damaged sampler "
                             f"state (carry holds example {beyond[0]}, beyond the dataset's "
                             f"{self.num_examples} examples)")


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
    "PackedSamplerConfig",
    "PlannedBatch",
]
