"""Length pools: the shipped ``*.txt`` files of example lengths, and streams drawn from them.

The pool-based ``megatron-packing simulate``, the benchmarks and the golden plans draw their
example streams here, so every one of them sees the same lengths for the same seed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

DEFAULT_POOL_DIRS = ("benchmarks/data/lengths", "../shared/data/lengths")
MIXED = "mixed"
"""The pool name that draws a source uniformly, then a length from it (`mixed_stream`)."""


def find_pool_dir(explicit: str | None = None) -> Path:
    """The folder of ``*.txt`` length pools: the given one, or the project's copy."""
    candidates = [Path(explicit)] if explicit else [Path(p) for p in DEFAULT_POOL_DIRS]
    package_root = Path(__file__).resolve().parent.parent
    if not explicit:
        candidates += [package_root / p for p in DEFAULT_POOL_DIRS]
    for candidate in candidates:
        if candidate.is_dir() and any(candidate.glob("*.txt")):
            return candidate
    tried = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"no length pools (*.txt, one length per line) found in: {tried}")


def load_pools(pool_dir: str | Path) -> dict[str, np.ndarray]:
    """Every ``*.txt`` pool in a folder, by name (file stem)."""
    pools = {}
    for path in sorted(Path(pool_dir).glob("*.txt")):
        values = np.loadtxt(path, dtype=np.int64, ndmin=1)
        if values.size == 0 or values.min() <= 0:
            raise ValueError(f"{path}: a pool needs positive integer lengths, one per line")
        pools[path.stem] = values
    if not pools:
        raise FileNotFoundError(f"{pool_dir}: no *.txt length pools")
    return pools


def mixed_stream(pools: dict[str, np.ndarray], count: int, capacity: int, seed: int = 0) -> np.ndarray:
    """Draw a source uniformly, then a length from it (with replacement); clip to the capacity."""
    rng = np.random.default_rng(seed)
    names = sorted(pools)
    sources = rng.integers(0, len(names), size=count)
    out = np.empty(count, dtype=np.int64)
    for s, name in enumerate(names):
        chosen = np.flatnonzero(sources == s)
        out[chosen] = pools[name][rng.integers(0, len(pools[name]), size=chosen.size)]
    return np.minimum(out, capacity)


def pool_stream(pools: dict[str, np.ndarray], name: str, count: int, capacity: int,
                seed: int = 0) -> np.ndarray:
    """``count`` lengths from the pool ``name`` (or `MIXED`), drawn with replacement and clipped
    to the capacity. An unknown name raises ValueError naming the pools there are."""
    if name == MIXED:
        return mixed_stream(pools, count, capacity, seed=seed)
    if name not in pools:
        raise ValueError(f"unknown pool {name!r}; choose {MIXED!r} or one of "
                         f"{', '.join(sorted(pools))}")
    rng = np.random.default_rng(seed)
    return np.minimum(rng.choice(pools[name], size=count), capacity)
