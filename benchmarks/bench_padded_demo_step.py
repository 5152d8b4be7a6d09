"""Per-step time of the CPU demo trainer in padded mode: token budget vs fixed micro-batch sizes.

Runs the real demo trainer (2 gloo ranks, a tiny megatron-core GPT) once per setting on the
same data and model, and reads each run's metrics: ``perf/step_seconds`` (rank 0's forward,
backward and optimizer step) and the pad efficiency (real tokens / padded tokens, b x L summed
over the step's micro-batches). The first ``--warmup`` steps of each run are left out.

    nice -n 10 python benchmarks/bench_padded_demo_step.py --backend fsdp2 --budget 1024
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, also in the spawned ranks


def _document(root: Path, args: argparse.Namespace, padded: dict[str, Any]) -> dict[str, Any]:
    data = root / "data.jsonl"
    if not data.exists():
        lines = (REPO / "examples" / "data" / "demo_chat.jsonl").read_text().splitlines()
        data.write_text("\n".join(lines[:args.examples]) + "\n")
    return {
        "packing": {"global_batch_size": args.global_batch_size, "use_sequence_packing": False,
                    "seed": 3, **padded},
        "data": {"paths": [str(data)], "tokenizer": str(REPO / "examples" / "tokenizer"),
                 "cache_dir": str(root / "cache")},
        "model": {"num_layers": args.layers, "hidden_size": args.hidden,
                  "num_attention_heads": 4},
        "train": {"steps": args.steps, "lr": 0.003, "warmup_steps": 2, "dp_size": 2,
                  "checkpoint_every": 10_000, "backend": args.backend, "log_every": 10_000},
        "logging": {"wandb": False, "plot": False},
    }


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_setting(root: Path, name: str, args: argparse.Namespace,
                padded: dict[str, Any]) -> dict[str, Any]:
    from megatron_packing.config.training import training_config_from_dict
    from megatron_packing.demo.trainer import RunSpec, launch_runs
    from megatron_packing.loader.metrics import read_jsonl

    cfg = training_config_from_dict(_document(root, args, padded))
    out = root / name
    started = time.perf_counter()
    launch_runs(cfg, [RunSpec(output_dir=str(out), use_wandb=False, quiet=True)])
    wall = time.perf_counter() - started
    records = read_jsonl(out / "metrics.jsonl")[args.warmup:]
    seconds = [r["perf/step_seconds"] for r in records]
    real = sum(r["train/actual_num_tokens"] for r in records)
    padded_tokens = sum(r["train/padded_tokens"] for r in records)
    return {
        "setting": name, "steps": len(records),
        "median_s": statistics.median(seconds), "p99_s": _percentile(seconds, 0.99),
        "mean_s": statistics.fmean(seconds),
        "micro_batches": statistics.fmean(r["train/micro_batches_per_rank"] for r in records),
        "pad_efficiency": real / padded_tokens, "launch_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="fsdp2", choices=("fsdp2", "megatron_ddp"))
    parser.add_argument("--budget", type=int, action="append",
                        help="token budget(s) to run (repeatable; default 1024)")
    parser.add_argument("--examples", type=int, default=256)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()
    settings: list[tuple[str, dict[str, Any]]] = [
        ("mbs=1", {"micro_batch_size": 1}), ("mbs=2", {"micro_batch_size": 2})]
    settings += [(f"budget={b}", {"max_tokens_per_microbatch": b})
                 for b in (args.budget or [1024])]
    with tempfile.TemporaryDirectory(prefix="bench-padded-demo-") as tmp:
        rows = [run_setting(Path(tmp), name, args, padded) for name, padded in settings]
    base = rows[0]["median_s"]
    print(f"backend {args.backend}; {args.examples} demo examples, B={args.global_batch_size}, "
          f"dp=2, {args.steps} steps ({args.warmup} warm-up left out), "
          f"GPT {args.layers} layers x {args.hidden}")
    print("| setting | steps | median s/step | p99 s/step | vs mbs=1 | micro-batches/rank "
          "| pad efficiency |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['setting']} | {row['steps']} | {row['median_s']:.4f} | {row['p99_s']:.4f} "
              f"| {row['median_s'] / base:.2f}x | {row['micro_batches']:.1f} "
              f"| {row['pad_efficiency']:.3f} |")


if __name__ == "__main__":
    main()
