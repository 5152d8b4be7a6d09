"""The sequence packer contract and its three algorithms (MFFD, FFD, BFD).

A packer turns example lengths into bins: lists of positions into the input. Steps:

1. validate lengths (positive integers, 1-D);
2. apply the oversize policy to items whose padded length exceeds the usable capacity;
3. sort padded sizes largest first, ties by original position (a stable sort on
   ``(-size, position)``), and run the algorithm;
4. with ``dp_size``, round the bin count up to a multiple of dp (`dp_rounding.round_to_dp`,
   the planner's mechanism too).

Output order is deterministic: oversize ``own_bin`` singletons first (largest first, ties by
position), then bins in the order the algorithm opened them; bins added by splitting are
appended. Positions inside every bin are ascending.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from enum import StrEnum
from typing import ClassVar

import numpy as np

from megatron_packing.common.validation import require_int, require_positive_int

from .alignment import Alignment
from .dp_rounding import round_to_dp
from .fit import best_fit_decreasing, first_fit_decreasing, group_by_bin
from .mffd import modified_first_fit_decreasing
from .rebin import fit_into_count, split_to_count

#: Inputs up to this size have their natural packing memoised (planner-sized calls).
_MEMO_MAX_ITEMS = 1 << 16


class PackingAlgorithm(StrEnum):
    """Names of the packing algorithms."""

    MFFD = "mffd"
    FFD = "ffd"
    BFD = "bfd"


class OversizePolicy(StrEnum):
    """What to do with an example whose padded length exceeds the usable capacity."""

    ERROR = "error"
    TRUNCATE = "truncate"
    OWN_BIN = "own_bin"


class OversizeSequenceError(ValueError):
    """An example does not fit an empty bin and the policy is ``error``."""


def validate_lengths(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """Lengths as a 1-D int64 array; ValueError naming the first bad position and value."""
    if not isinstance(lengths, np.ndarray):
        seq = lengths if isinstance(lengths, Sequence) else list(lengths)
        types = set(map(type, seq))
        if bool in types or np.bool_ in types:
            pos = next(i for i, x in enumerate(seq) if isinstance(x, bool | np.bool_))
            raise ValueError(f"lengths[{pos}] = {seq[pos]!r} is a bool, not a length")
        arr = np.asarray(seq)
    else:
        arr = lengths
    if arr.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    kind = arr.dtype.kind
    if kind == "b":
        raise ValueError(f"lengths[0] = {arr[0]!r} is a bool, not a length")
    if kind == "O":
        for pos, x in enumerate(arr.tolist()):
            if isinstance(x, bool) or not isinstance(x, int | float | np.integer | np.floating):
                raise ValueError(f"lengths[{pos}] = {x!r} is not an integer length")
        arr = arr.astype(np.float64)
        kind = "f"
    if kind == "f":
        bad = np.flatnonzero(~np.isfinite(arr) | (arr != np.floor(arr)))
        if len(bad):
            pos = int(bad[0])
            raise ValueError(f"lengths[{pos}] = {arr[pos].item()!r} is not an integer length")
    elif kind not in "iu":
        raise ValueError(f"lengths must be integers, got dtype {arr.dtype}")
    bad = np.flatnonzero(arr <= 0)
    if len(bad):
        pos = int(bad[0])
        raise ValueError(f"lengths[{pos}] = {arr[pos].item()!r} must be a positive integer")
    return arr.astype(np.int64)


class SeqPacker(ABC):
    """Packs sequence lengths into bins of ``bin_capacity`` tokens under an :class:`Alignment`.

    With ``dp_size``, `pack` returns a multiple of dp bins, at least dp (`round_to_dp`); without
    it, the algorithm's natural packing, which the step planner needs (it rounds by itself).
    """

    algorithm: ClassVar[PackingAlgorithm]

    def __init__(
        self,
        bin_capacity: int,
        *,
        alignment: Alignment | None = None,
        dp_size: int | None = None,
        oversize_policy: OversizePolicy | str = "error",
    ) -> None:
        self._alignment = alignment if alignment is not None else Alignment()
        if not isinstance(self._alignment, Alignment):
            raise TypeError(f"alignment must be an Alignment, got {type(alignment).__name__}")
        self._usable = self._alignment.usable_capacity(bin_capacity)
        self._bin_capacity = int(bin_capacity)
        self.dp_size = require_positive_int("dp_size", dp_size, allow_none=True, error=ValueError)
        try:
            self.oversize_policy = OversizePolicy(oversize_policy)
        except ValueError:
            valid = ", ".join(p.value for p in OversizePolicy)
            raise ValueError(
                f"unknown oversize_policy {oversize_policy!r}; valid policies: {valid}"
            ) from None
        self._max_len = self._alignment.max_sequence_length(bin_capacity)
        # One-entry memo of the last natural packing: planners call pack() and then
        # pack_to_count() on the same lengths.
        self._memo: tuple[bytes, list[list[int]]] | None = None

    @property
    def bin_capacity(self) -> int:
        """Tokens per bin as configured."""
        return self._bin_capacity

    @property
    def alignment(self) -> Alignment:
        """Alignment rules applied to every sequence and bin."""
        return self._alignment

    @property
    def usable_capacity(self) -> int:
        """Capacity rounded down to the per-bin multiple: the budget for padded lengths."""
        return self._usable

    def __repr__(self) -> str:
        dp = f", dp_size={self.dp_size}" if self.dp_size is not None else ""
        return (
            f"{type(self).__name__}(bin_capacity={self._bin_capacity}, "
            f"alignment={self._alignment!r}, oversize_policy={self.oversize_policy.value!r}{dp})"
        )

    # -- the algorithm -------------------------------------------------------------------
    @abstractmethod
    def _kernel(self, sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
        """Bin of each item of ``sizes`` (sorted largest first) and the bin count."""

    # -- lengths -------------------------------------------------------------------------
    def _prepare(self, lengths: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Aligned effective sizes and the mask of ``own_bin`` oversize items."""
        raw = validate_lengths(lengths)
        padded = self._alignment.padded_lengths(raw)
        over = padded > self._usable
        if not over.any():
            return padded, over
        if self.oversize_policy is OversizePolicy.ERROR:
            pos = int(np.flatnonzero(over)[0])
            raise OversizeSequenceError(
                f"example at position {pos} has length {int(raw[pos])} (padded length "
                f"{int(padded[pos])}), which exceeds the usable bin capacity {self._usable} "
                f"(bin_capacity {self._bin_capacity}); use oversize_policy 'truncate' or "
                f"'own_bin', or a larger bin_capacity"
            )
        if self.oversize_policy is OversizePolicy.TRUNCATE:
            eff = np.minimum(raw, self._max_len)
            return self._alignment.padded_lengths(eff), np.zeros(len(raw), dtype=bool)
        return padded, over

    def effective_lengths(self, lengths: Sequence[int] | np.ndarray) -> np.ndarray:
        """Lengths after the oversize policy (``truncate`` clips to the longest that fits)."""
        raw = validate_lengths(lengths)
        self._prepare(raw)  # raises under the error policy
        if self.oversize_policy is OversizePolicy.TRUNCATE:
            return np.minimum(raw, self._max_len)
        return raw

    def lower_bound(self, lengths: Sequence[int] | np.ndarray) -> int:
        """Fewest bins possible: ceil(padded total / usable capacity), own-bin items one each."""
        return self._lower_bound(*self._prepare(lengths))

    def _lower_bound(self, sizes: np.ndarray, own: np.ndarray) -> int:
        n_own = int(own.sum())
        total = int(sizes.sum()) if n_own == 0 else int(sizes[~own].sum())
        return -(-total // self._usable) + n_own

    # -- packing -------------------------------------------------------------------------
    def _natural(self, sizes: np.ndarray, own: np.ndarray) -> list[list[int]]:
        """Bins of positions as the algorithm packs them, own-bin singletons first."""
        if len(sizes) > _MEMO_MAX_ITEMS:
            return self._natural_uncached(sizes, own)
        key = sizes.tobytes() + own.tobytes()
        if self._memo is None or self._memo[0] != key:
            self._memo = (key, self._natural_uncached(sizes, own))
        return [list(b) for b in self._memo[1]]

    def _natural_uncached(self, sizes: np.ndarray, own: np.ndarray) -> list[list[int]]:
        bins: list[list[int]] = []
        if own.any():
            own_pos = np.flatnonzero(own)
            own_pos = own_pos[np.argsort(-sizes[own_pos], kind="stable")]
            bins.extend([p] for p in own_pos.tolist())
            normal = np.flatnonzero(~own)
        else:
            normal = None
        sub = sizes if normal is None else sizes[normal]
        if len(sub) == 0:
            return bins
        order = np.argsort(-sub, kind="stable")
        bin_of, n_bins = self._kernel(sub[order], self._usable)
        by_item = np.empty(len(sub), dtype=np.int64)
        by_item[order] = bin_of
        positions = np.arange(len(sub)) if normal is None else normal
        grouped = group_by_bin(by_item, n_bins)
        if normal is None:
            bins.extend(grouped)
        else:
            pos_list = positions.tolist()
            bins.extend([pos_list[i] for i in b] for b in grouped)
        return bins

    def pack(self, lengths: Sequence[int] | np.ndarray) -> list[list[int]]:
        """Pack ``lengths`` into bins of positions; see the module docstring for the order.

        Raises :class:`OversizeSequenceError` for a too-long example under the ``error``
        policy. With ``dp_size``, empty bins are placeholders: there were fewer examples than
        the multiple of dp.
        """
        sizes, own = self._prepare(lengths)
        bins = self._natural(sizes, own)
        if self.dp_size is None:
            return bins
        return round_to_dp(bins, sizes, self.dp_size)[0]

    def pack_to_count(
        self, lengths: Sequence[int] | np.ndarray, num_bins: int
    ) -> list[list[int]] | None:
        """Exactly ``num_bins`` non-empty fitting bins holding every item, or None.

        More bins than the natural packing: balanced splitting. Fewer: packing capped at
        ``num_bins`` (first, best, then worst fit) plus a bounded repair; a heuristic, so it
        can return None for a count that some packing could reach. Ignores ``dp_size``.
        """
        count = require_int("num_bins", num_bins, minimum=0, error=ValueError)
        assert count is not None  # allow_none is off
        num_bins = count
        sizes, own = self._prepare(lengths)
        n = len(sizes)
        if n == 0:
            return [] if num_bins == 0 else None
        if num_bins > n or num_bins < self._lower_bound(sizes, own):
            return None
        bins = self._natural(sizes, own)
        if len(bins) <= num_bins:
            return split_to_count(bins, sizes.tolist(), num_bins)
        n_own = int(own.sum())
        normal = np.flatnonzero(~own)
        sub = sizes[normal]
        order = np.argsort(-sub, kind="stable")
        packed = fit_into_count(sub[order], self._usable, num_bins - n_own)
        if packed is None:
            return None
        pos_sorted = normal[order].tolist()
        return bins[:n_own] + [sorted(pos_sorted[i] for i in b) for b in packed]


class MFFDPacker(SeqPacker):
    """Modified First-Fit Decreasing (worst case 71/60 OPT + 1); the default."""

    algorithm = PackingAlgorithm.MFFD

    def _kernel(self, sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
        return modified_first_fit_decreasing(sizes, capacity)


class FFDPacker(SeqPacker):
    """First-Fit Decreasing (worst case 11/9 OPT + 6/9), O(n log n) with an eligible-bin heap."""

    algorithm = PackingAlgorithm.FFD

    def _kernel(self, sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
        return first_fit_decreasing(sizes, capacity)


class BFDPacker(SeqPacker):
    """Best-Fit Decreasing (same worst case as FFD), O(n log n) with bucketed rooms."""

    algorithm = PackingAlgorithm.BFD

    def _kernel(self, sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
        return best_fit_decreasing(sizes, capacity)
