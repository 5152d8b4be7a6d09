"""A tiny in-memory SFT dataset with known token ids and loss masks."""

from __future__ import annotations

import numpy as np


class SyntheticSFT:
    """Example i has tokens ``(i * 7 + t) % 1000 + 1`` and a loss mask on its second half."""

    def __init__(self, lengths) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int32)
        self.loss_token_counts = np.array(
            [self._mask(n)[1:].sum() for n in self.lengths], dtype=np.int32
        )

    @staticmethod
    def _mask(n: int) -> np.ndarray:
        mask = np.zeros(n, dtype=np.uint8)
        mask[n // 2:] = 1
        return mask

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        n = int(self.lengths[i])
        ids = (np.arange(n, dtype=np.int64) + i * 7) % 1000 + 1
        return {"input_ids": ids, "loss_mask": self._mask(n)}


def mixed_lengths(n: int, seed: int = 0, low: int = 8, high: int = 900) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.exp(rng.uniform(np.log(low), np.log(high), size=n)).astype(np.int64)
