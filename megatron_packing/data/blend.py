"""Deterministic weighted blends of several sources.

A blend of sources with sizes ``n_k`` and weights ``w_k`` has ``N = sum(n_k)`` examples. Source
``k`` contributes ``round(N * w_k / sum(w))`` of them (largest-remainder rounding, so the counts
add up to ``N``): whole shuffled passes over the source, then a shuffled partial pass, so a
down-weighted source is subsampled without repeats and an up-weighted one is repeated evenly.
The blended order is a seeded shuffle, so a sequential sampler already sees the sources mixed.
The same sizes, weights and seed always give the same blend.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megatron_packing.common.validation import require_number


def validate_weights(weights: Sequence[object], num_sources: int) -> list[float]:
    """Check weights are positive finite numbers, one per source; return them as floats."""
    if len(weights) != num_sources:
        raise ValueError(f"got {len(weights)} weights for {num_sources} sources; give one weight per source")
    return [require_number(f"weights[{k}]", w, minimum=0, exclusive=True, error=ValueError)
            for k, w in enumerate(weights)]


def blend_counts(sizes: Sequence[int], weights: Sequence[float]) -> np.ndarray:
    """Examples taken from each source: proportional to weight, summing to ``sum(sizes)``."""
    total = int(sum(sizes))
    w = np.asarray(weights, dtype=np.float64)
    exact = total * w / w.sum()
    counts = np.floor(exact).astype(np.int64)
    rest = total - int(counts.sum())
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[:rest]] += 1
    return counts


def blend_indices(sizes: Sequence[int], weights: Sequence[float], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Return (source id int32, index within source int64) for every blended example."""
    for k, n in enumerate(sizes):
        if n <= 0:
            raise ValueError(f"source {k} has no usable examples and cannot take a blend weight")
    counts = blend_counts(sizes, weights)
    rng = np.random.default_rng(seed)
    part_ids, local_ids = [], []
    for k, (n, c) in enumerate(zip(sizes, counts, strict=True)):
        full, part = divmod(int(c), int(n))
        picks = [rng.permutation(n) for _ in range(full)]
        picks.append(rng.permutation(n)[:part])
        local_ids.append(np.concatenate(picks).astype(np.int64))
        part_ids.append(np.full(int(c), k, dtype=np.int32))
    sources = np.concatenate(part_ids)
    local = np.concatenate(local_ids)
    order = rng.permutation(len(sources))
    return sources[order], local[order]
