"""Benchmark support: time each call of Bridge's ``train_step`` on global rank 0.

`install(path)` wraps ``megatron.bridge.training.train.train_step`` (Bridge's own ``train()`` and
the Bridge host both look it up there) and writes ``[[start_s, ms], ...]`` to ``path`` at exit,
so that a loop's own time per step (data, bookkeeping, logging) is the wall time between two
steps' starts minus the step itself (benchmarks/bench_bridge_overhead.py).
"""

from __future__ import annotations

import atexit
import json
import os
import time
from typing import Any


def install(path: str) -> None:
    from megatron.bridge.training import train

    calls: list[list[float]] = []
    step = train.train_step

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        out = step(*args, **kwargs)
        calls.append([started, (time.perf_counter() - started) * 1000])
        return out

    def write() -> None:
        with open(path, "w") as out:
            json.dump(calls, out)

    train.train_step = timed
    if os.environ.get("RANK", "0") == "0":
        atexit.register(write)
