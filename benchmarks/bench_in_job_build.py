"""Wall time from launch to the first training step, with the length index built inside the
job (the ranks sharing the build) and with a cache prepared ahead of it
(``megatron-packing prepare``).

Uses the data of the in-job build test (`write_slow_build_data`: conversations of four demo
chats, tokenized through the prefix fallback) and runs the Megatron-LM entry point (the CPU test
launcher) under torchrun with 2 gloo ranks, a tiny GPT and ``--distributed-timeout-minutes 1``.
"first step" is when rank 0's step record of iteration 1 appears. Three launches: on an empty
cache (the job builds), ``prepare`` on another empty cache, then the job on that prepared cache.

    python benchmarks/bench_in_job_build.py [--seconds S] [--out results.md]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "megatron_lm"))

from megatron_lm_runs import (  # noqa: E402
    SKIP_REASON,
    SLOW_BUILD_SECONDS,
    _env,
    logged_iterations,
    torchrun_command,
    write_sft_yaml,
    write_slow_build_data,
)

sys.path.insert(0, str(ROOT / "benchmarks"))
from report import Report  # noqa: E402

ITERS = 3  # above --lr-warmup-iters 2


def time_to_first_step(yaml: Path, log_dir: Path) -> tuple[float, float]:
    """(seconds from launch to rank 0's first step record, seconds of the whole job)."""
    command = torchrun_command(2, ["--packing-config", str(yaml), "--global-batch-size", "16",
                                   "--train-iters", str(ITERS), "--distributed-timeout-minutes",
                                   "1", "--packing-log-dir", str(log_dir)])
    started = time.perf_counter()
    proc = subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    first = None
    while proc.poll() is None:
        if first is None and logged_iterations(log_dir) >= 1:
            first = time.perf_counter() - started
        time.sleep(0.05)
    total = time.perf_counter() - started
    output = proc.communicate()[0]
    if proc.returncode != 0 or first is None:
        raise SystemExit(f"the job failed ({proc.returncode}):\n{output[-4000:]}")
    return first, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=SLOW_BUILD_SECONDS,
                        help="size the data to build in about this long on this machine")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args()
    if SKIP_REASON is not None:
        raise SystemExit(SKIP_REASON)
    report = Report(args.out)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        data, records = write_slow_build_data(tmp / "data", args.seconds)
        size = (data / "train.jsonl").stat().st_size / 2**20
        cold = write_sft_yaml(tmp / "cold.yaml", data, tokenizer=data / "tokenizer",
                              cache=tmp / "cold_cache")
        in_job = time_to_first_step(cold, tmp / "log_cold")
        prepared = write_sft_yaml(tmp / "prepared.yaml", data, tokenizer=data / "tokenizer",
                                  cache=tmp / "prepared_cache")
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "megatron_packing.cli", "prepare", "--config",
                        str(prepared)], env=_env(), check=True, capture_output=True)
        prepare_s = time.perf_counter() - started
        warm = time_to_first_step(prepared, tmp / "log_prepared")
    report.print(f"# Launch to first step: length index built in the job vs prepared "
                 f"({records:,} records, {size:.1f} MB JSONL)")
    report.print()
    report.print("torchrun, 2 CPU ranks (gloo), tiny GPT, `--distributed-timeout-minutes 1`, "
                 f"{ITERS} iterations. In the job both ranks tokenize parts of the index and one "
                 "merges them; `prepare` builds it in one process (1 worker).")
    report.print()
    report.print("| cache | prepare s | launch to first step s | whole job s |")
    report.print("|---|---:|---:|---:|")
    report.print(f"| empty: built in the job (the 2 ranks share the build) | - | "
                 f"{in_job[0]:.1f} | {in_job[1]:.1f} |")
    report.print(f"| prepared ahead (`megatron-packing prepare`) | {prepare_s:.1f} | "
                 f"{warm[0]:.1f} | {warm[1]:.1f} |")
    report.save()


if __name__ == "__main__":
    main()
