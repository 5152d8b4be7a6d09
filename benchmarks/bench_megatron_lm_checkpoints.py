"""Save and load time per checkpoint of the Megatron-LM entry point: torch_dist against torch.

``python -m megatron_packing.megatron_lm`` (through the CPU test launcher) under torchrun, 2
data-parallel gloo ranks, the tests' tiny GPT, saving every 2 iterations for 8 iterations, then
a ``--load`` run (the same ``--train-iters``, so it loads and trains no step), for
``--ckpt-format torch`` and ``torch_dist``, interleaved round by round. The times are Megatron's own timers, as it prints them: the
``save-checkpoint`` timer of ``save_checkpoint_and_time`` (the save, the packing loader state
written by Megatron's dataloader hook, and the barriers around it) and the ``load-checkpoint``
timer of ``setup_model_and_optimizer``; the maximum across ranks. The first save of a run is
reported apart (torch_dist starts its writer and caches its save plan there).

    python benchmarks/bench_megatron_lm_checkpoints.py [--rounds 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "megatron_lm"))

from megatron_lm_runs import SKIP_REASON, launch, write_sft_yaml  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from report import Report  # noqa: E402

FORMATS = ("torch", "torch_dist")


def timer_lines(output: str, name: str) -> list[float]:
    """Max-across-ranks ms of every ``name`` line Megatron's ``timers.log`` printed."""
    pattern = re.compile(rf"^\s*{re.escape(name)} \.+: \(([\d.]+), ([\d.]+)\)", re.MULTILINE)
    return [float(match.group(2)) for match in pattern.finditer(output)]


def _size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--save-interval", type=int, default=2)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args()
    if SKIP_REASON:
        raise SystemExit(f"skipped: {SKIP_REASON}")
    report = Report(args.out)
    report.print(f"Machine: {os.cpu_count()} CPUs (nproc), load average "
                 f"{os.getloadavg()[0]:.1f} at start. Megatron-LM entry point, tiny GPT "
                 f"(2 layers, hidden 32), 2 DP ranks (gloo, CPU), B={args.global_batch_size}, "
                 f"{args.iters} iterations saving every {args.save_interval}, then a --load run; "
                 f"{args.rounds} rounds interleaved ({', '.join(FORMATS)}).")
    report.print("")
    first: dict[str, list[float]] = {f: [] for f in FORMATS}
    later: dict[str, list[float]] = {f: [] for f in FORMATS}
    loads: dict[str, list[float]] = {f: [] for f in FORMATS}
    sizes: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as tmp_name:
        tmp = Path(tmp_name)
        chats = (ROOT / "examples" / "data" / "demo_chat.jsonl").read_text().splitlines()
        (tmp / "train.jsonl").write_text("\n".join(chats[:600]) + "\n")
        (tmp / "valid.jsonl").write_text("\n".join(chats[600:664]) + "\n")
        yaml = write_sft_yaml(tmp / "sft.yaml", tmp)
        common = ["--packing-config", str(yaml), "--global-batch-size",
                  str(args.global_batch_size), "--eval-iters", "0", "--eval-interval",
                  str(args.iters)]
        for round_ in range(args.rounds):
            for fmt in FORMATS:
                save = tmp / f"ckpt_{fmt}_{round_}"
                saved = launch(2, [*common, "--ckpt-format", fmt, "--train-iters",
                                   str(args.iters), "--save", str(save), "--save-interval",
                                   str(args.save_interval)],
                               tmp / f"log_{fmt}_{round_}_save", timeout=900)
                if saved.returncode != 0:
                    raise SystemExit(f"{fmt} save run failed:\n{saved.output[-5000:]}")
                times = timer_lines(saved.output, "save-checkpoint")
                if len(times) != args.iters // args.save_interval:
                    raise SystemExit(f"{fmt}: {len(times)} save-checkpoint timer lines, expected "
                                     f"{args.iters // args.save_interval}")
                first[fmt].append(times[0])
                later[fmt] += times[1:]
                sizes[fmt] = _size_mb(save / f"iter_{args.iters:07d}")
                # The same --train-iters (the LR schedule's length must match): load, no steps.
                loaded = launch(2, [*common, "--ckpt-format", fmt, "--train-iters",
                                    str(args.iters), "--load", str(save)],
                                tmp / f"log_{fmt}_{round_}_load", timeout=900)
                if loaded.returncode != 0:
                    raise SystemExit(f"{fmt} load run failed:\n{loaded.output[-5000:]}")
                if f"restored the packing loader state of iteration {args.iters}" \
                        not in loaded.output:
                    raise SystemExit(f"{fmt}: the load run did not resume iteration {args.iters}")
                load_times = timer_lines(loaded.output, "load-checkpoint")
                if len(load_times) != 1:
                    raise SystemExit(f"{fmt}: {len(load_times)} load-checkpoint timer lines")
                loads[fmt] += load_times
                print(f"  round {round_ + 1} {fmt}: saves {', '.join(f'{t:.0f}' for t in times)} "
                      f"ms, load {load_times[0]:.0f} ms", flush=True)
    report.print("Per checkpoint, ms (max across the 2 ranks, Megatron's timers), medians over "
                 f"{args.rounds} runs per format:")
    report.print("")
    report.print("| format | first save | later saves (median) | later saves (max) | "
                 "load (median) | checkpoint size MB |")
    report.print("|---|---|---|---|---|---|")
    for fmt in FORMATS:
        report.print(f"| {fmt} | {statistics.median(first[fmt]):.0f} | "
                     f"{statistics.median(later[fmt]):.0f} | {max(later[fmt]):.0f} | "
                     f"{statistics.median(loads[fmt]):.0f} | {sizes[fmt]:.2f} |")
    report.print("")
    ratio = {key: statistics.median(values["torch_dist"]) / statistics.median(values["torch"])
             for key, values in (("first", first), ("later", later), ("load", loads))}
    report.print(f"torch_dist / torch: first save {ratio['first']:.2f}x, later saves "
                 f"{ratio['later']:.2f}x, load {ratio['load']:.2f}x")
    report.print("")
    report.print("Samples: " + "; ".join(
        f"{fmt} first {[round(t) for t in first[fmt]]}, later {[round(t) for t in later[fmt]]}, "
        f"load {[round(t) for t in loads[fmt]]}" for fmt in FORMATS))
    report.save()


if __name__ == "__main__":
    main()
