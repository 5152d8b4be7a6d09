"""`TokenBudgetBatchSampler`: the stateful batch sampler of padded (non-packed) mode.

Each step takes the next B examples of the epoch's order (the epoch's last step takes what
remains), splits them into dp contiguous slices of equal count (sizes differ by at most one when
B is not a multiple of dp), and splits this rank's slice into padded micro-batches:

- with a token budget: the slice is sorted by length (longest first, ties in input order) and cut
  with `make_token_balanced_microbatches` (balanced split by default, see `SAMPLER_SPLIT_METHOD`);
- without one: consecutive chunks of ``micro_batch_size`` in input order.

Every rank computes every rank's schedule (same seed, same lengths), so the step's micro-batch
count is agreed with no collective: the maximum over ranks, shorter ranks padded with ``None``.
"""

from __future__ import annotations

import math
import time
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
from megatron_packing.common.plan_types import PaddedStepPlan
from megatron_packing.common.validation import require_bool, require_int, require_positive_int
from megatron_packing.config.components import SAMPLER_SPLIT_METHOD, PaddedConfig
from megatron_packing.packing.microbatch import (
    example_lengths,
    fixed_size_microbatches,
    make_token_balanced_microbatches,
    sort_by_length,
)
from megatron_packing.stream.base_order import EpochOrder
from megatron_packing.stream.state_checks import (
    check_fingerprint,
    check_state_fields,
    check_state_keys,
)
from megatron_packing.stream.step_stream import OrderPosition, StepStream


def rank_slices(num_examples: int, dp_size: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) slices of a global batch: equal counts, +-1 when not divisible."""
    bounds = [(rank * num_examples) // dp_size for rank in range(dp_size + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def split_rank_share(
    share_lengths: np.ndarray,
    max_tokens: int | None,
    micro_batch_size: int,
    method: str = SAMPLER_SPLIT_METHOD,
) -> list[list[int]]:
    """Micro-batches of one rank's share, as positions into the share."""
    positions = list(range(len(share_lengths)))
    if not positions:
        return []
    if max_tokens is None:
        return fixed_size_microbatches(positions, micro_batch_size)
    ordered = sort_by_length(positions, share_lengths, descending=True)
    return make_token_balanced_microbatches(ordered, share_lengths, max_tokens, method=method)


@dataclass
class PaddedCursor:
    """Where one iterator stands in the padded stream, with the budget schedule it follows."""

    order: OrderPosition
    step: int = 0  # steps planned since the start of the run
    max_tokens: int | None = None  # the budget of the last planned step
    budget_changes: dict[int, int] = field(default_factory=dict)  # from step -> budget


@dataclass(frozen=True)
class PaddedSamplerConfig:
    """Everything `TokenBudgetBatchSampler` plans with, besides the data and the rank."""

    global_batch_size: int
    dp_size: int
    padded: PaddedConfig = PaddedConfig()
    seed: int = 0
    """Seeds the epochs of a random base sampler that has no generator of its own."""
    eval_mode: bool = False
    """Marks the plans as evaluation; an evaluation reads whole epochs whatever total_steps."""

    def __post_init__(self) -> None:
        check_field(self, "global_batch_size", require_positive_int)
        check_field(self, "dp_size", require_positive_int)
        require_component(self, "padded", PaddedConfig)
        check_seed(self)
        check_field(self, "eval_mode", require_bool)

    @classmethod
    def from_settings(cls, global_batch_size: int, dp_size: int, *, owner: str,
                      **settings: Any) -> PaddedSamplerConfig:
        """The config of the sampler's keyword form: each flat setting is a field of
        `PaddedConfig` or this config (their defaults apply to the rest)."""
        padded, mine = split_settings((PaddedConfig, _Own), settings, owner=owner)
        return cls(global_batch_size=global_batch_size, dp_size=dp_size,
                   padded=PaddedConfig(**padded), **mine)

    def settings(self) -> dict[str, Any]:
        """The flat settings `from_settings` takes back (B and dp aside)."""
        out = {f.name: getattr(self.padded, f.name) for f in fields(self.padded)}
        out.update(seed=self.seed, eval_mode=self.eval_mode)
        return out

    def build(self, sampler: Iterable[int], lengths: Sequence[int] | np.ndarray, *,
              dp_rank: int | None = None, total_steps: int | None = None,
              loss_token_counts: Sequence[int] | np.ndarray | None = None,
              targets: Mapping[str, Any] | None = None) -> TokenBudgetBatchSampler:
        """The sampler over ``sampler``'s order and ``lengths``, yielding ``dp_rank``'s steps
        (None: the global batch)."""
        return TokenBudgetBatchSampler(
            sampler, lengths, self.global_batch_size, self.dp_size, dp_rank=dp_rank,
            total_steps=total_steps, loss_token_counts=loss_token_counts, targets=targets,
            **self.settings())


@dataclass(frozen=True)
class _Own:
    """`PaddedSamplerConfig`'s own flat settings (for `split_settings`)."""

    seed: int = 0
    eval_mode: bool = False


class TokenBudgetBatchSampler(StepStream[PaddedCursor, PaddedStepPlan]):
    """Stateful batch sampler for padded micro-batches under a token budget (see module doc).

    ``sampler`` gives the epoch's example order (any sized sampler; see `EpochOrder`).
    ``lengths[i]`` is example i's token count; ``loss_token_counts[i]`` (optional) its trained
    tokens, so each plan carries the global loss-token count. ``settings`` are `PaddedConfig`'s
    fields (``max_tokens_per_microbatch``, ``micro_batch_size``, ``split_method``), ``seed`` and
    ``eval_mode``. With ``dp_rank=None`` the yielded list is the whole global batch (for
    simulation) and ``schedule`` is rank 0's. ``total_steps`` ends the run after that many steps
    (across epochs); an evaluation (``eval_mode``) reads whole epochs whatever ``total_steps``.
    ``targets`` (`state_checks.target_fingerprint`) joins the state's fingerprint, so a resume
    with other loss masks, tokenizer or template is refused. `PaddedSamplerConfig.build` makes
    one from a config.
    """

    def __init__(
        self,
        sampler: Iterable[int],
        lengths: Sequence[int] | np.ndarray,
        global_batch_size: int,
        dp_size: int,
        *,
        dp_rank: int | None = None,
        total_steps: int | None = None,
        loss_token_counts: Sequence[int] | np.ndarray | None = None,
        targets: Mapping[str, Any] | None = None,
        **settings: Any,
    ) -> None:
        config = PaddedSamplerConfig.from_settings(global_batch_size, dp_size,
                                                   owner="TokenBudgetBatchSampler", **settings)
        self.config = config
        self.global_batch_size = config.global_batch_size
        self.dp_size = config.dp_size
        self.dp_rank = require_int("dp_rank", dp_rank, minimum=0, maximum=config.dp_size - 1,
                                   allow_none=True)
        self.micro_batch_size = config.padded.micro_batch_size
        self._max_tokens = config.padded.max_tokens_per_microbatch
        self.split_method = config.padded.split_method
        self.eval_mode = config.eval_mode
        # evaluation reads its epoch whole, as in packed mode; total_steps bounds training runs
        total_steps = require_positive_int("total_steps", total_steps, allow_none=True)
        self.total_steps = None if self.eval_mode else total_steps
        self.base_sampler = sampler
        self.seed = config.seed
        self._order = EpochOrder(sampler, seed=config.seed)  # the order's length and fingerprint
        if len(self._order) == 0:
            raise ValueError(
                "the dataset has 0 examples (the base sampler covers none): there is nothing to "
                "plan; check the data sources (an empty file, or every record skipped)"
            )
        self.lengths = example_lengths(np.asarray(lengths))
        if self.lengths.size != len(self._order):
            raise ValueError(
                f"lengths holds {self.lengths.size} entries but the base sampler yields "
                f"{len(self._order)} examples per epoch; they must describe the same dataset"
            )
        self._order_fingerprint = {**self._order.fingerprint(), **(targets or {})}
        self.loss_token_counts: np.ndarray | None = None
        if loss_token_counts is not None:
            counts = example_lengths(np.asarray(loss_token_counts))
            if counts.size != self.lengths.size:
                raise ValueError(
                    f"loss_token_counts holds {counts.size} entries but lengths holds {self.lengths.size}"
                )
            self.loss_token_counts = counts
        self._init_stream()

    # ------------------------------------------------------------------ sizes and epochs
    def __len__(self) -> int:
        """Steps per epoch: ceil(N / B)."""
        return math.ceil(len(self._order) / self.global_batch_size)

    @property
    def epoch(self) -> int:
        return self._position().order.epoch

    @property
    def next_step(self) -> int:
        """The index of the next step this sampler will plan (steps count across epochs)."""
        return self._position().step

    @property
    def max_tokens(self) -> int | None:
        """The budget in force for the next planned step (None: fixed micro_batch_size)."""
        cursor = self._position()
        return self._budget_for(cursor, cursor.step)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; the current epoch keeps its cursor (for resume)."""
        cursor = self._position()
        if int(epoch) != cursor.order.epoch:
            cursor.order.start_epoch(int(epoch))
            self._position_changed()

    def set_max_tokens(self, max_tokens: int, from_step: int | None = None) -> None:
        """Change the token budget from ``from_step`` (default: the next planned step) on."""
        budget = require_positive_int("max_tokens", max_tokens)
        cursor = self._position()
        start = cursor.step if from_step is None else int(from_step)
        if start < cursor.step:
            raise ValueError(
                f"cannot change the budget from step {start}: steps up to {cursor.step - 1} "
                "are already planned"
            )
        cursor.budget_changes = {s: b for s, b in cursor.budget_changes.items() if s < start}
        cursor.budget_changes[start] = budget
        self._position_changed()

    def _budget_for(self, cursor: PaddedCursor, step: int) -> int | None:
        budget = cursor.max_tokens
        for start in sorted(cursor.budget_changes):
            if start <= step:
                budget = cursor.budget_changes[start]
        return budget

    # ------------------------------------------------------------------ planning
    def _new_cursor(self) -> PaddedCursor:
        return PaddedCursor(OrderPosition(EpochOrder(self.base_sampler, seed=self.seed)),
                            max_tokens=self._max_tokens)

    def _begin(self, cursor: PaddedCursor) -> None:
        if cursor.order.consumed > 0 and cursor.order.remaining == 0:
            cursor.order.start_epoch(cursor.order.epoch + 1)

    def _next_step(self, cursor: PaddedCursor) -> PaddedStepPlan | None:
        if cursor.order.remaining <= 0:
            return None
        if self.total_steps is not None and cursor.step >= self.total_steps:
            return None  # the run's horizon: steps count across epochs
        return self._plan_next(cursor)

    def _plan_next(self, cursor: PaddedCursor) -> PaddedStepPlan:
        started = time.perf_counter()
        budget = self._budget_for(cursor, cursor.step)
        cursor.max_tokens = budget
        cursor.budget_changes = {s: b for s, b in cursor.budget_changes.items() if s > cursor.step}
        epoch = cursor.order.epoch
        global_batch = cursor.order.take(self.global_batch_size)
        lengths = self.lengths[np.asarray(global_batch, dtype=np.int64)]
        slices = rank_slices(len(global_batch), self.dp_size)
        schedules = [
            split_rank_share(lengths[a:b], budget, self.micro_batch_size,
                             self.split_method)
            for a, b in slices
        ]
        count = max(len(schedule) for schedule in schedules)
        padded = [
            sum(len(group) * int(lengths[a:b][group].max()) for group in schedule)
            for (a, b), schedule in zip(slices, schedules, strict=True)
        ]
        rank = 0 if self.dp_rank is None else self.dp_rank
        start, end = slices[rank]
        mine = global_batch[start:end] if self.dp_rank is not None else global_batch
        positions: list[list[int] | None] = [list(group) for group in schedules[rank]]
        positions += [None] * (count - len(positions))
        offset = 0 if self.dp_rank is not None else start
        schedule_positions = [
            None if group is None else [offset + p for p in group] for group in positions
        ]
        step = cursor.step
        cursor.step += 1
        return PaddedStepPlan(
            indices=tuple(int(i) for i in mine),
            step=step,
            epoch=epoch,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            max_tokens=budget,
            micro_batch_size=self.micro_batch_size,
            schedule_positions=schedule_positions,
            schedule=[None if group is None else [int(mine[p]) for p in group]
                      for group in schedule_positions],
            microbatches_per_rank=count,
            rank_num_examples=[b - a for a, b in slices],
            rank_padded_tokens=padded,
            rank_real_microbatches=[len(schedule) for schedule in schedules],
            global_num_examples=len(global_batch),
            global_num_tokens=int(lengths.sum()),
            global_num_loss_tokens=(
                int(self.loss_token_counts[np.asarray(global_batch, dtype=np.int64)].sum())
                if self.loss_token_counts is not None
                else None
            ),
            plan_ms=(time.perf_counter() - started) * 1000.0,
            is_eval=self.eval_mode,
        )

    # ------------------------------------------------------------------ state
    def _fingerprint(self) -> dict[str, Any]:
        return {
            "num_examples": int(self.lengths.size),
            "global_batch_size": self.global_batch_size,
            "dp_size": self.dp_size,
            "micro_batch_size": self.micro_batch_size,
            "split_method": self.split_method,
            "eval_mode": self.eval_mode,
            "lengths_sum": int(self.lengths.sum()),
            **self._order_fingerprint,
        }

    def _cursor_state(self, cursor: PaddedCursor) -> dict[str, Any]:
        return {
            "order": cursor.order.state_dict(),
            "epoch": cursor.order.epoch,
            "step": cursor.step,
            "max_tokens": cursor.max_tokens,
            "budget_changes": sorted(cursor.budget_changes.items()),
            "fingerprint": self._fingerprint(),
        }

    def _cursor_from_state(self, state: dict[str, Any]) -> PaddedCursor:
        return PaddedCursor(
            order=OrderPosition(EpochOrder(self.base_sampler, seed=self.seed), state["order"]),
            step=int(state["step"]),
            max_tokens=state["max_tokens"],
            budget_changes={int(s): int(b) for s, b in state["budget_changes"]},
        )

    def check_state(self, state: Any) -> None:
        """Raise unless ``state`` is a complete state of this sampler's setup (loads nothing)."""
        check_state_keys(state, ("order", "step", "max_tokens", "budget_changes", "fingerprint"),
                         "TokenBudgetBatchSampler")
        check_state_fields(state, {"order": ("dict", None), "epoch": ("int", 0),
                                   "step": ("int", 0), "max_tokens": ("int_or_none", 1),
                                   "budget_changes": ("int_pairs", 0),
                                   "fingerprint": ("dict", None)}, "TokenBudgetBatchSampler")
        check_fingerprint(state["fingerprint"], self._fingerprint())


__all__ = [
    "SAMPLER_SPLIT_METHOD",
    "PaddedSamplerConfig",
    "PaddedStepPlan",
    "TokenBudgetBatchSampler",
    "rank_slices",
    "split_rank_share",
]
