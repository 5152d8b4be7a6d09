"""Time to produce one rank's packed step through the real loader (sampler + fetch + collate).

A synthetic in-memory dataset with lengths from the mixed real pool; `build_sft_dataloader` with
`align_packing_bins_to_dp: true`; rank 0 of dp ranks. Reports the time the training loop waits
in ``next(loader)`` per step, with collation in the main process (workers 0) and prefetched by
2 workers while a simulated training step (a sleep, 200 ms by default) runs. Prints a markdown
table; not a timed test.

    python benchmarks/bench_loader_step.py [--steps 40] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from report import Report  # noqa: E402

from megatron_packing.config import PackingConfig  # noqa: E402
from megatron_packing.loader.dataloader import build_sft_dataloader  # noqa: E402
from megatron_packing.reports.pools import find_pool_dir, load_pools, mixed_stream  # noqa: E402


class SyntheticTokens:
    """Examples of the given lengths with pseudo-random ids and an assistant-half loss mask."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths.astype(np.int32)
        # Targets at positions t >= 1 whose mask is set (the mask covers the second half).
        self.loss_token_counts = (self.lengths - np.maximum(self.lengths // 2, 1)).astype(np.int32)
        self._ids = np.random.default_rng(0).integers(1, 32000, size=int(lengths.max()))

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        n = int(self.lengths[i])
        mask = np.zeros(n, dtype=np.uint8)
        mask[n // 2:] = 1
        return {"input_ids": self._ids[:n], "loss_mask": mask}


def measure(dataset, config, dp: int, steps: int, workers: int,
            step_seconds: float) -> tuple[np.ndarray, float]:
    loader = build_sft_dataloader(dataset, config, dp_rank=0, dp_size=dp, seed=0,
                                  num_workers=workers)
    waits, rows = [], 0
    iterator = iter(loader)
    next(iterator)  # start-up (worker launch) is not a per-step cost
    for _ in range(steps):
        started = time.perf_counter()
        batch = next(iterator)
        waits.append((time.perf_counter() - started) * 1e3)
        rows += len(batch.micro_batches)
        time.sleep(step_seconds)  # stand-in for the training step the workers overlap with
    return np.asarray(waits), rows / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-ms", type=float, default=200.0,
                        help="simulated training step that prefetching overlaps with")
    parser.add_argument("--out", default=None, help="also save the table here")
    args = parser.parse_args()
    report = Report(args.out)
    pools = load_pools(find_pool_dir())
    report.print(f"simulated training step: {args.step_ms:.0f} ms, {args.steps} steps")
    report.print()
    report.print("| B / capacity / dp | workers | wait per step median | p99 "
                 "| rows per rank per step |")
    report.print("|---|---|---|---|---|")
    for batch, capacity, dp in ((128, 4096, 8), (1024, 65536, 4)):
        lengths = mixed_stream(pools, batch * (args.steps + 4), capacity, seed=0)
        dataset = SyntheticTokens(lengths)
        config = PackingConfig(global_batch_size=batch, bin_capacity=capacity,
                               align_packing_bins_to_dp=True, oversize_policy="truncate")
        for workers in (0, 2):
            waits, rows = measure(dataset, config, dp, args.steps, workers, args.step_ms / 1e3)
            report.print(f"| {batch} / {capacity:,} / {dp} | {workers} | {np.median(waits):.2f} ms "
                         f"| {np.percentile(waits, 99):.2f} ms | {rows:.1f} |")
    report.save()


if __name__ == "__main__":
    main()
