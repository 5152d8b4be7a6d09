"""Measure length-index build rate and cached load time for many short synthetic chats.

Prints a Markdown table (and writes it with ``--out``). This is a measurement, not a test.

    python benchmarks/bench_length_index.py --records 100000 --out benchmarks/results/bench_length_index.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_records(path: Path, n: int, seed: int = 0) -> None:
    """Short chats (tens of tokens each) with varied numbers so no two lines repeat."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            rec = {"messages": [
                {"role": "user", "content": f"Question {i}: what is {a} + {b}?"},
                {"role": "assistant", "content": f"{a} + {b} = {a + b}."},
            ]}
            f.write(json.dumps(rec) + "\n")


def _tree_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def _peak_mib(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # Linux: KiB


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--num-proc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokenizer", default=str(ROOT / "examples" / "tokenizer"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    from megatron_packing.data import load_length_index, load_sft_dataset
    from megatron_packing.data.tokenize import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "short.jsonl"
        write_records(data, args.records)
        size_mb = data.stat().st_size / 1e6
        for num_proc in args.num_proc:
            cache = Path(tmp) / f"cache{num_proc}"
            t0 = time.perf_counter()
            ds = load_sft_dataset(data, tok, cache_dir=cache, num_proc=num_proc, show_progress=False)
            build = time.perf_counter() - t0
            t0 = time.perf_counter()
            again = load_sft_dataset(data, tok, cache_dir=cache, num_proc=num_proc, show_progress=False)
            cached = time.perf_counter() - t0
            t0 = time.perf_counter()
            idx = load_length_index(again.index_paths[0])
            total = int(idx.lengths.sum())
            index_only = time.perf_counter() - t0
            t0 = time.perf_counter()
            for i in range(0, len(again), max(1, len(again) // 10_000)):
                again[i]
            fetch_us = (time.perf_counter() - t0) / min(len(again), 10_000) * 1e6
            rows.append((num_proc, len(ds), total, build, len(ds) / build, cached, index_only,
                         fetch_us, _peak_mib(resource.RUSAGE_SELF),
                         _peak_mib(resource.RUSAGE_CHILDREN) if num_proc > 1 else None,
                         _tree_mib(cache)))

    lines = [
        f"# Length index benchmark ({args.records:,} short synthetic chats, {size_mb:.1f} MB JSONL)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs visible "
        "(shared with other jobs while measured), Python " + platform.python_version() + ".",
        "Build = parse + validate + chat template + tokenize + write the memory-mapped store.",
        "Cached load = `load_sft_dataset` again (hashes the data file or reuses its remembered "
        "hash, checks the key, maps arrays).",
        "",
        "Peak RSS: the main process's peak so far (run one `--num-proc` per process for a "
        "row's own peak) and the largest worker's.",
        "",
        "| num_proc | records | tokens | build s | build records/s | cached load s | "
        "load_length_index + sum s | ds[i] us | peak RSS MiB (main / worker) | cache MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p, n, tokens, build, rate, cached, index_only, fetch, main_mib, worker_mib, cache_mib \
            in rows:
        peak = f"{main_mib:,.0f}" + (f" / {worker_mib:,.0f}" if worker_mib is not None else "")
        lines.append(
            f"| {p} | {n:,} | {tokens:,} | {build:.1f} | {rate:,.0f} | {cached:.3f} | "
            f"{index_only:.4f} | {fetch:.1f} | {peak} | {cache_mib:,.0f} |"
        )
    command = "python benchmarks/bench_length_index.py " + " ".join(argv or sys.argv[1:])
    text = f"Command: `{command}`\n\n" + "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return text


if __name__ == "__main__":
    main()
