"""A tiny synthetic SFT dataset for the padded-mode tests."""

from __future__ import annotations

import numpy as np


class SyntheticSFTDataset:
    """``num_examples`` examples with random lengths, token ids and loss masks (seeded)."""

    def __init__(self, num_examples: int = 300, *, seed: int = 0, min_len: int = 2,
                 max_len: int = 400, vocab: int = 1000) -> None:
        rng = np.random.default_rng(seed)
        self.lengths = rng.integers(min_len, max_len + 1, size=num_examples).astype(np.int32)
        self._ids = [rng.integers(1, vocab, size=int(n)).astype(np.int64) for n in self.lengths]
        self._masks = [(rng.random(int(n)) < 0.6).astype(np.uint8) for n in self.lengths]
        for mask in self._masks:  # every example trains at least its last token
            if not mask[1:].any():
                mask[-1] = 1
        # Targets are the tokens after the first one (labels are the next token).
        self.loss_token_counts = np.array([int(m[1:].sum()) for m in self._masks], dtype=np.int64)

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {"input_ids": self._ids[index].copy(), "loss_mask": self._masks[index].copy()}
