"""What the Megatron-LM entry point's loop adds to a training step, measured on a real run.

Runs ``python -m megatron_packing.megatron_lm`` (through the CPU test launcher, which applies the
CPU shims) under torchrun with 2 data-parallel gloo ranks and a tiny GPT, then reads the per-step
records: ``compute_ms`` is Megatron's schedule plus the optimizer step, ``data_ms`` the wait for
the step's batch, and ``overhead_ms`` everything else the loop does per step (fetch, calculator
sync, row padding, LR step, metrics), i.e. step time minus compute.

    python benchmarks/bench_megatron_lm_step.py [--iters 40] [--workers 0] [--out results.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "megatron_lm"))

from megatron_lm_runs import SKIP_REASON, launch, write_sft_yaml  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from report import Report, p99  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=0, help="--packing-num-workers")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args()
    if SKIP_REASON:
        raise SystemExit(SKIP_REASON)
    report = Report(args.out)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        chats = (ROOT / "examples" / "data" / "demo_chat.jsonl").read_text().splitlines()
        (tmp / "train.jsonl").write_text("\n".join(chats) + "\n")
        (tmp / "valid.jsonl").write_text("\n".join(chats[:32]) + "\n")
        yaml = write_sft_yaml(tmp / "sft.yaml", tmp)
        started = time.perf_counter()
        run = launch(2, ["--packing-config", str(yaml), "--global-batch-size",
                         str(args.global_batch_size), "--train-iters", str(args.iters),
                         "--packing-num-workers", str(args.workers)],
                     tmp / "log", timeout=1800)
        wall = time.perf_counter() - started
        if run.returncode != 0:
            raise SystemExit(run.output[-4000:])
        steps = run.steps(0)[1:]  # the first step includes one-off warm-up
    report.print(f"Megatron-LM entry point, 2 DP ranks (gloo, CPU), B={args.global_batch_size}, "
                f"{args.iters} iterations, {args.workers} loader workers, wall {wall:.1f} s including start-up; rank 0, "
                f"steps 2..{args.iters}")
    report.print("")
    report.print("| per step | median ms | p99 ms |")
    report.print("|---|---|---|")
    for key, label in (("step_ms", "whole step"), ("compute_ms", "Megatron schedule + optimizer"),
                       ("data_ms", "wait for the step's batch"),
                       ("overhead_ms", "loop overhead (step - compute)")):
        values = [s[key] for s in steps]
        report.print(f"| {label} | {statistics.median(values):.2f} | {p99(values):.2f} |")
    share = [s["overhead_ms"] / s["step_ms"] for s in steps]
    report.print("")
    report.print(f"Loop overhead share of the step: median {100 * statistics.median(share):.1f}%")
    report.save()


if __name__ == "__main__":
    main()
