"""SFTDataset: examples from one or more token stores, in a fixed order."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from .store import TokenStore


class SFTDataset:
    """Tokenized SFT examples backed by memory-mapped token stores.

    ``ds[i]`` returns ``{"input_ids": int64 array, "loss_mask": uint8 array}`` of equal length,
    read from the memory map (no re-reading of source data). ``lengths`` and
    ``loss_token_counts`` (``loss_mask[1:].sum()`` per example: the targets a next-token loss
    trains on) are int32 arrays available without touching any example.
    """

    def __init__(
        self,
        stores: Sequence[TokenStore],
        *,
        part_ids: np.ndarray | None = None,
        local_ids: np.ndarray | None = None,
        options: dict[str, Any],
        fingerprint: str,
        extra_skipped: dict[str, int] | None = None,
    ) -> None:
        self.stores = list(stores)
        self._extra_skipped = Counter(extra_skipped or {})  # rows left out when loading
        self.options = dict(options)
        self.fingerprint: str = fingerprint
        if part_ids is None:
            sizes = [len(s) for s in self.stores]
            part_ids = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
            local_ids = np.concatenate([np.arange(n, dtype=np.int64) for n in sizes]) if sizes else np.zeros(0, np.int64)
        assert local_ids is not None and len(part_ids) == len(local_ids)
        self._part = np.asarray(part_ids, dtype=np.int32)
        self._local = np.asarray(local_ids, dtype=np.int64)
        self._identity = len(self.stores) == 1 and np.array_equal(self._local, np.arange(len(self._local)))
        if self._identity:
            self.lengths: np.ndarray = self.stores[0].lengths
            self.loss_token_counts: np.ndarray = self.stores[0].loss_token_counts
        else:
            self.lengths = self._gather("lengths")
            self.loss_token_counts = self._gather("loss_token_counts")

    def _gather(self, attr: str) -> np.ndarray:
        out = np.zeros(len(self._part), dtype=np.int32)
        for k, store in enumerate(self.stores):
            sel = self._part == k
            out[sel] = np.asarray(getattr(store, attr))[self._local[sel]]
        return out

    def __len__(self) -> int:
        return len(self._part)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        n = len(self._part)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} out of range for SFTDataset of {n} examples")
        return self.stores[self._part[i]].get(int(self._local[i]))

    def example_origin(self, i: int) -> str:
        """Where example ``i`` came from, as ``source:line`` (for error messages)."""
        store = self.stores[self._part[i]]
        line = int(store.record_lines[int(self._local[i])])
        return f"{store.meta.get('source', store.path)}:{line}"

    @property
    def skipped(self) -> Counter[str]:
        """Bad records skipped while building, counted by reason (empty when none)."""
        total: Counter[str] = Counter(self._extra_skipped)
        for store in self.stores:
            total.update(store.meta.get("skipped", {}))
        return total

    @property
    def special_token_records(self) -> int:
        """Records whose message content held a control token's text (see
        ``special_tokens_in_content``), summed over the stores."""
        return sum(int(store.meta.get("special_token_records", 0)) for store in self.stores)

    @property
    def index_paths(self) -> list[str]:
        """Directories of the underlying stores (see ``load_length_index``)."""
        return [str(s.path) for s in self.stores]

    @property
    def num_tokens(self) -> int:
        return int(np.asarray(self.lengths, dtype=np.int64).sum())

    def __repr__(self) -> str:
        return (
            f"SFTDataset({len(self)} examples, {self.num_tokens} tokens, "
            f"{len(self.stores)} source(s), skipped={dict(self.skipped)})"
        )
