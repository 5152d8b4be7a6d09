"""Cost of the stricter checks: the strict YAML reader, the loss-target check over a 100k-example
dataset when a loader is built, the sampler-state field checks, and the per-step fetch check.

"Before" is the same code with the new check switched off in this process (interleaved runs,
so both see the same machine load): the strict loader replaced by ``yaml.SafeLoader``, the
loss-target check and the state field checks by no-ops. Prints markdown tables; not a test.

    python benchmarks/bench_strict_checks.py [--examples 100000] [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import yaml  # noqa: E402

from megatron_packing.config import PackingConfig, yaml_io  # noqa: E402
from megatron_packing.packed import components  # noqa: E402
from megatron_packing.packed import sampler as packed_sampler
from megatron_packing.reports.pools import find_pool_dir, load_pools, mixed_stream  # noqa: E402
from megatron_packing.stream.fetch import check_fetched  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


class IndexedData:
    """A dataset with a length index (what `SFTDataset` offers), examples made on demand."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths.astype(np.int32)
        self.loss_token_counts = (self.lengths - self.lengths // 2 - (self.lengths % 2 == 0)
                                  ).astype(np.int32)
        self.loss_token_counts = np.maximum(self.loss_token_counts, 1)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        n = int(self.lengths[i])
        mask = np.zeros(n, np.uint8)
        mask[n - int(self.loss_token_counts[i]):] = 1
        return {"input_ids": np.arange(n), "loss_mask": mask}


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        out.append((time.perf_counter() - started) * 1e3)
    return out


def row(name: str, before: list[float], after: list[float]) -> str:
    b, a = np.median(before), np.median(after)
    return (f"| {name} | {b:,.3f} ms | {a:,.3f} ms | {np.percentile(before, 99):,.3f} ms | "
            f"{np.percentile(after, 99):,.3f} ms | {a - b:+,.3f} ms |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batch", type=int, default=1024)
    args = parser.parse_args()
    lengths = mixed_stream(load_pools(find_pool_dir()), args.examples, 4096, seed=0)
    data = IndexedData(lengths)
    config = PackingConfig(global_batch_size=128, bin_capacity=4096,
                           align_packing_bins_to_dp=True)
    times: dict[str, dict[str, list[float]]] = {}

    def both(name: str, switch_off, switch_on, fn) -> None:
        times[name] = {"before": [], "after": []}
        for _ in range(args.repeats):  # interleaved
            switch_off()
            times[name]["before"] += timed(fn, 1)
            switch_on()
            times[name]["after"] += timed(fn, 1)

    # 1. the YAML reader on the demo config
    strict = yaml_io.StrictLoader
    text = (REPO / "configs" / "demo_cpu.yaml").read_text()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.yaml"
        path.write_text(text)

        def use_loader(loader):
            return lambda: setattr(yaml_io, "StrictLoader", loader)

        both("read + check the demo YAML (read_yaml_mapping + from_dict)",
             use_loader(yaml.SafeLoader), use_loader(strict),
             lambda: PackingConfig.from_dict(yaml_io.read_yaml_mapping(path)["packing"]))

    # 2. building the packed sampler over the dataset (the loss-target check runs here)
    real_check = components.check_loss_targets
    both(f"build the packed sampler over {args.examples:,} examples",
         lambda: setattr(components, "check_loss_targets", lambda *a: None),
         lambda: setattr(components, "check_loss_targets", real_check),
         lambda: components.build_packing_sampler(data, config, dp_rank=0, dp_size=2))
    times["the loss-target check alone"] = {
        "before": [0.0] * args.repeats,
        "after": timed(lambda: real_check(data, data.loss_token_counts), args.repeats)}

    # 3. loading a sampler state (field checks)
    sampler = components.build_packing_sampler(data, config, dp_rank=0, dp_size=2)
    steps = iter(sampler)
    for _ in range(5):
        next(steps)
    state = sampler.state_dict()
    real_fields = packed_sampler.check_state_fields
    both("check a saved sampler state (check_state)",
         lambda: setattr(packed_sampler, "check_state_fields", lambda *a: None),
         lambda: setattr(packed_sampler, "check_state_fields", real_fields),
         lambda: sampler.check_state(state))

    # 4. the per-step fetch check (unchanged by these checks; for scale)
    rng = np.random.default_rng(1)
    indices = rng.choice(len(data), size=args.batch, replace=False).tolist()
    examples = [data[i] for i in indices]
    fetch = timed(lambda: check_fetched(data, indices, examples, {}), args.repeats)
    times[f"per-step fetch check, B = {args.batch} (code unchanged)"] = {"before": fetch,
                                                                        "after": fetch}

    print(f"{args.examples:,} examples (mixed real pool, C = 4096), {args.repeats} repeats\n")
    print("| what | before (median) | after (median) | before p99 | after p99 | added |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, t in times.items():
        print(row(name, t["before"], t["after"]))


if __name__ == "__main__":
    main()
