"""The plans and step facts that travel between the samplers, the collators and the metrics.

A leaf module: it imports nothing from the project, so every layer may share these types.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any


class TupleSequence(Sequence[Any]):
    """A read-only sequence over the tuple that ``_items`` names (a dataclass field).

    What the DataLoader hands to a dataset, and what the collator receives, are such sequences
    with the step's plan alongside."""

    _items: str = "indices"

    def __len__(self) -> int:
        return len(getattr(self, self._items))

    def __getitem__(self, position: Any) -> Any:
        return getattr(self, self._items)[position]

    def __iter__(self) -> Iterator[Any]:
        return iter(getattr(self, self._items))


@dataclass(frozen=True, slots=True)
class RowLayout:
    """Where one bin's sequences go in its THD row, decided once, by the planner.

    Sequence ``i`` keeps ``real[i]`` tokens (after truncation) and occupies the next
    ``segments[i]`` tokens of the row: its TP/CP-aligned length, and for the last sequence also
    the row's padding up to ``length``. The collator writes tokens into these segments and
    computes nothing. A placeholder row (a bin without examples) is one segment holding one pad
    token.
    """

    real: tuple[int, ...]
    segments: tuple[int, ...]

    @property
    def length(self) -> int:
        """Tokens in the row: a multiple of the per-bin multiple (or the capacity, padded to it)."""
        return sum(self.segments)


@dataclass(frozen=True)
class StepPlan:
    """Everything every rank needs to know about one step; identical on all ranks."""

    step: int  # global step index, 0-based
    epoch: int
    step_in_epoch: int
    dp_size: int
    bin_capacity: int
    example_indices: tuple[int, ...]  # the global batch, in base order
    bins: tuple[tuple[int, ...], ...]  # dataset indices per bin; () is a placeholder row
    layouts: tuple[RowLayout, ...]  # per bin, its row: segments and row length, final
    rank_bins: tuple[tuple[int, ...], ...]  # per rank, the ids of its bins
    truncated: dict[int, int]  # dataset index -> tokens kept (oversize policy "truncate")
    num_tokens: int  # real tokens in the global batch
    num_loss_tokens: int | None  # tokens trained on (None when loss counts are unknown)
    packed_bins: int  # bins the packer made before padding to a multiple of dp
    padding_bins: int
    placeholder_bins: int
    aligned: bool
    hopeless: bool
    token_fill: float
    dp_imbalance: float
    plan_ms: float
    drift: int  # emitted - steps x B within the epoch, after this step
    is_eval: bool = False
    packs: int = 0  # sizes the search evaluated
    packer_runs: int = 0  # packer runs really made (lookahead included, memo hits excluded)
    deferred: tuple[int, ...] = ()  # examples of this step's window left to lead the next step
    evened: bool = False  # took the nominal tokens where no size of any step ahead saves a bin

    @property
    def num_examples(self) -> int:
        return len(self.example_indices)

    @property
    def num_bins(self) -> int:
        return len(self.bins)

    @property
    def micro_batches_per_rank(self) -> int:
        return len(self.bins) // self.dp_size

    def bins_of_rank(self, rank: int) -> list[tuple[int, ...]]:
        return [self.bins[b] for b in self.rank_bins[rank]]

    def examples_of_rank(self, rank: int) -> list[int]:
        return [index for b in self.rank_bins[rank] for index in self.bins[b]]


@dataclass
class StepMetadata:
    """Global facts about one step, identical on every rank (they come from the shared plan)."""

    step: int
    epoch: int
    num_examples: int  # real examples in the global batch (train/actual_batch_size)
    num_tokens: int  # real tokens in the global batch
    num_loss_tokens: int | None  # tokens trained on, global: the loss divisor (None: unknown)
    num_bins: int  # micro-batches over all ranks (a multiple of dp)
    num_padding_bins: int  # bins added beyond the packer's count to reach a multiple of dp
    num_placeholder_bins: int  # bins with no example at all (zero-loss placeholder rows)
    micro_batches_per_rank: int
    token_fill: float  # real tokens / (bins x capacity)
    dp_imbalance: float  # max-rank cost / mean-rank cost
    plan_ms: float  # time spent planning this step
    aligned: bool  # bin count reached a multiple of dp without padding bins
    is_eval: bool = False
    evened: bool = False  # took the nominal tokens: no size of it or those ahead saved a bin
    extra: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PaddedStepPlan(TupleSequence):
    """This rank's example indices for one step (input order), with the step's plan.

    A read-only sequence of dataset indices (what the DataLoader hands to ``__getitems__``) that
    is its own plan. ``schedule_positions[m]`` lists positions into it for micro-batch ``m``;
    ``schedule[m]`` lists the same examples as dataset indices. Dummy micro-batches are ``None``.
    """

    indices: tuple[int, ...]
    step: int
    epoch: int
    dp_rank: int | None
    dp_size: int
    max_tokens: int | None
    micro_batch_size: int
    schedule_positions: list[list[int] | None]
    schedule: list[list[int] | None]
    microbatches_per_rank: int
    rank_num_examples: list[int]
    rank_padded_tokens: list[int]
    rank_real_microbatches: list[int]
    global_num_examples: int
    global_num_tokens: int
    global_num_loss_tokens: int | None
    plan_ms: float
    is_eval: bool

    @property
    def plan(self) -> PaddedStepPlan:
        """The step's plan: this list itself (what the fetching dataset looks for)."""
        return self

    @property
    def global_padded_tokens(self) -> int:
        return int(sum(self.rank_padded_tokens))

    @property
    def pad_efficiency(self) -> float:
        """Real tokens / padded tokens over the whole step (1.0 = no padding)."""
        padded = self.global_padded_tokens
        return self.global_num_tokens / padded if padded else 1.0

    @property
    def num_dummy_microbatches(self) -> int:
        return sum(self.microbatches_per_rank - real for real in self.rank_real_microbatches)

    @property
    def dp_imbalance(self) -> float:
        """Slowest rank's padded tokens / mean rank's padded tokens."""
        mean = self.global_padded_tokens / max(self.dp_size, 1)
        return max(self.rank_padded_tokens) / mean if mean else 1.0
