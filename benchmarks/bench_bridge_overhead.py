"""Per-step time of the Bridge host's loop against Megatron-Bridge's own ``train()``.

Two runs of the same tiny GPT (tests/bridge/tiny_recipe.py: 2 layers, hidden 64, rows of 256
tokens) under torchrun, 2 data-parallel gloo ranks on CPU with the test shims, alternating round
by round:

* **Bridge train()**: Bridge's ``pretrain()`` with its own ``gpt_step.forward_step`` and an
  external iterator of ready micro-batches (tests/bridge/run_bridge_cpu.py), micro-batch 1,
  4 rows per rank per step;
* **packing host**: the same recipe through `megatron_packing.bridge` (packed demo chats, B 16,
  3-4 rows per rank per step; tests/bridge/run_bridge_host.py).

Both are timed the same way on rank 0 (tests/bridge/step_timings.py): Bridge's ``train_step``
is wrapped; a step's time is the wall time between the starts of two consecutive ``train_step``
calls, and "loop + data" is that minus the ``train_step`` call (everything the loop does around
it: fetching or planning data, counting, logging, the exit checks). The first 3 steps of each run
are left out.

    python benchmarks/bench_bridge_overhead.py [--iters 40] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "bridge"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bridge_runs import BRIDGE_SKIP, RUN_HOST, _env, write_yaml  # noqa: E402
from report import Report, p99  # noqa: E402

RUN_BRIDGE = ROOT / "tests" / "bridge" / "run_bridge_cpu.py"
WARMUP = 3


def _torchrun(script: Path, args: list[str], port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
            f"--master-port={port}", str(script), *args]


def _run(command: list[str], timings: Path) -> list[list[float]]:
    proc = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{command[5]} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(timings.read_text())


def _per_step(calls: list[list[float]]) -> tuple[list[float], list[float]]:
    """(step ms, loop + data ms) of each step after the warm-up."""
    steps, loop = [], []
    for (start, ms), (next_start, _) in zip(calls, calls[1:], strict=False):
        wall = (next_start - start) * 1000
        steps.append(wall)
        loop.append(wall - ms)
    return steps[WARMUP:], loop[WARMUP:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    if BRIDGE_SKIP is not None:
        raise SystemExit(f"cannot run: {BRIDGE_SKIP}")
    report = Report(args.out)
    results: dict[str, tuple[list[float], list[float]]] = {"Bridge train()": ([], []),
                                                           "packing host": ([], [])}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        chats = (ROOT / "examples" / "data" / "demo_chat.jsonl").read_text().splitlines()
        (tmp / "train.jsonl").write_text("\n".join(chats[:1200]) + "\n")
        yaml = write_yaml(tmp / "sft.yaml", tmp)
        port = 32100
        for round_ in range(args.rounds):
            for name in results:
                port += 1
                timings = tmp / f"timings_{round_}_{name[0]}.json"
                if name == "Bridge train()":
                    command = _torchrun(RUN_BRIDGE, [
                        "--out", str(tmp / f"bridge_{round_}"), "--train-iters", str(args.iters),
                        "--global-batch-size", "8", "--seq-length", "256",
                        "--timings", str(timings)], port)
                else:
                    command = _torchrun(RUN_HOST, [
                        "--packing-config", str(yaml), "--train-iters", str(args.iters),
                        "--global-batch-size", "16", "--timings", str(timings)], port)
                steps, loop = _per_step(_run(command, timings))
                results[name][0].extend(steps)
                results[name][1].extend(loop)
                report.print(f"round {round_ + 1} {name}: step median "
                             f"{statistics.median(steps):.1f} ms, loop + data median "
                             f"{statistics.median(loop):.2f} ms")
    report.print()
    report.print(f"{args.rounds} rounds x {args.iters - WARMUP - 1} steps per run, 2 ranks, CPU")
    report.print()
    report.print("| loop | steps | step median ms | step p99 ms | loop + data median ms | "
                 "loop + data p99 ms |")
    report.print("|---|---:|---:|---:|---:|---:|")
    for name, (steps, loop) in results.items():
        report.print(f"| {name} | {len(steps)} | {statistics.median(steps):.1f} | "
                     f"{p99(steps):.1f} | {statistics.median(loop):.2f} | {p99(loop):.2f} |")
    bridge_loop = statistics.median(results["Bridge train()"][1])
    host_loop = statistics.median(results["packing host"][1])
    report.print()
    report.print(f"loop + data, packing host / Bridge train(): {host_loop / bridge_loop:.2f}x "
                 f"(median; {host_loop - bridge_loop:+.2f} ms per step)")
    report.print("Bridge train()'s external iterator yields ready micro-batches, read inside its "
                 "train_step; the host's loop + data includes planning and collating each step's "
                 "packed rows.")
    report.save()


if __name__ == "__main__":
    main()
