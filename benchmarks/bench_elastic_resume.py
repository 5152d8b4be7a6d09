"""Launch to first resumed step of the Megatron-LM entry point: a resume at the saved
data-parallel size against one at another size.

Both resumed runs have 2 ranks (DP 2, gloo, CPU, the tests' tiny GPT through the CPU test
launcher); they load an iteration-3 torch_dist checkpoint saved by a DP-2 run (same size) or by
a DP-1 run (another size: every rank plans from the global part of DP rank 0's loader state).
The time is from starting torchrun to the first resumed step's record in the step log, which
includes Python and Megatron start-up, the checkpoint load and the first step. Rounds alternate
the two cases.

    python benchmarks/bench_elastic_resume.py [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "megatron_lm"))

from megatron_lm_runs import (  # noqa: E402
    PROJECT,
    SKIP_REASON,
    _env,
    drain,
    launch,
    torchrun_command,
    write_sft_yaml,
)

sys.path.insert(0, str(ROOT / "benchmarks"))
from report import Report  # noqa: E402

B, ITERS, SAVED_AT = 16, 6, 3


def _args(yaml: Path, save: Path, *extra: str) -> list[str]:
    return ["--packing-config", str(yaml), "--global-batch-size", str(B), "--train-iters",
            str(ITERS), "--save", str(save), "--save-interval", str(SAVED_AT), "--eval-iters",
            "0", *extra]


def saved_checkpoint(work: Path, yaml: Path, dp: int) -> Path:
    save = work / f"saved_dp{dp}"
    run = launch(dp, _args(yaml, save, "--exit-interval", str(SAVED_AT)), work / f"log_{dp}")
    if run.returncode != 0:
        raise SystemExit(f"the DP-{dp} run did not save: {run.output[-2000:]}")
    return save


def seconds_to_first_resumed_step(work: Path, yaml: Path, saved: Path, tag: str) -> float:
    """Start a DP-2 ``--load`` of ``saved``; seconds until its first step is logged."""
    import shutil

    load = work / f"load_{tag}"
    shutil.rmtree(load, ignore_errors=True)
    shutil.copytree(saved, load)
    log = work / f"log_{tag}"
    shutil.rmtree(log, ignore_errors=True)
    started = time.perf_counter()
    proc = subprocess.Popen(torchrun_command(2, [*_args(yaml, load, "--load", str(load)),
                                                 "--packing-log-dir", str(log)]),
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    output = drain(proc)
    first = None
    records = log / "steps_rank0.jsonl"
    while proc.poll() is None and first is None:
        if records.exists() and any(line.endswith("}") and "examples" in json.loads(line)
                                    for line in records.read_text().splitlines()):
            first = time.perf_counter() - started
        time.sleep(0.02)
    proc.wait()
    if proc.returncode != 0 or first is None:
        raise SystemExit(f"the {tag} resume failed: {output()[-2000:]}")
    return first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args()
    if SKIP_REASON:
        raise SystemExit(f"skipped: {SKIP_REASON}")
    report = Report(args.out)
    report.print(f"Machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at "
                 f"start. Megatron-LM entry point, tiny GPT, resumed on 2 DP ranks (gloo, CPU) "
                 f"from an iteration-{SAVED_AT} torch_dist checkpoint; {args.rounds} rounds.")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "data"
        data.mkdir()
        chats = (PROJECT / "examples" / "data" / "demo_chat.jsonl").read_text().splitlines()
        (data / "train.jsonl").write_text("\n".join(chats[:96]) + "\n")
        (data / "valid.jsonl").write_text("\n".join(chats[96:112]) + "\n")
        yaml = write_sft_yaml(work / "sft.yaml", data)
        saved = {dp: saved_checkpoint(work, yaml, dp) for dp in (2, 1)}
        times: dict[str, list[float]] = {"same size (DP 2 -> 2)": [],
                                         "another size (DP 1 -> 2)": []}
        for round_ in range(args.rounds):
            for values, dp in zip(times.values(), (2, 1), strict=True):
                values.append(seconds_to_first_resumed_step(work, yaml, saved[dp],
                                                            f"{dp}_{round_}"))
    same = statistics.median(times["same size (DP 2 -> 2)"])
    report.print("| resume | median s | min s | max s | ratio to same size |")
    report.print("|---|---|---|---|---|")
    for label, values in times.items():
        report.print(f"| {label} | {statistics.median(values):.2f} | {min(values):.2f} | "
                     f"{max(values):.2f} | {statistics.median(values) / same:.3f} |")
    report.save()


if __name__ == "__main__":
    main()
