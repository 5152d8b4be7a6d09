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


def _status_mib(field: str) -> float:
    """A ``/proc/self/status`` memory field (``VmHWM``: peak RSS so far, ``RssAnon``,
    ``RssFile``) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _peak_mib(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # Linux: KiB


SHARER = """
import json, resource, sys, time
from pathlib import Path
from megatron_packing.data import load_sft_dataset
from megatron_packing.data.tokenize import load_tokenizer
data, cache, tokenizer, sharers, go = sys.argv[1:]
tokenizer = load_tokenizer(tokenizer)  # loaded before the start, as in the rows above
print("ready", flush=True)
while not Path(go).exists():
    time.sleep(0.005)
ds = load_sft_dataset(data, tokenizer, cache_dir=cache, show_progress=False,
                      build_sharers=int(sharers), num_proc=1)
print(json.dumps({"examples": len(ds), "end": time.time(),
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def shared_build_row(data: Path, cache: Path, tokenizer: str,
                     sharers: int) -> tuple[int, float, int, list[int], list[float], float]:
    """(records, wall s, parts, parts per process, peak RSS MiB per process, cache MiB) of one
    build shared by ``sharers`` processes started together."""
    import re
    import subprocess

    go = cache.parent / f"go{sharers}"
    procs = [subprocess.Popen([sys.executable, "-c", SHARER, str(data), str(cache), tokenizer,
                               str(sharers), str(go)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(sharers)]
    for p in procs:  # every process has imported and loaded the tokenizer: a common start
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    go.touch()
    start = time.time()
    results, here, parts = [], [], 0
    for p in procs:
        out, err = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"a sharer failed:\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
        found = re.search(r"\((\d+) of (\d+) parts tokenized here", err)
        here.append(int(found.group(1)) if found else 0)
        parts = int(found.group(2)) if found else parts
    wall = max(r["end"] for r in results) - start
    return (results[0]["examples"], wall, parts, here, [r["peak_mib"] for r in results],
            _tree_mib(cache))


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--num-proc", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--sharers", type=int, nargs="*", default=[],
                        help="also build with this many processes sharing it, as a job's ranks "
                             "do (each in one tokenizer process)")
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
            build_peak = _status_mib("VmHWM")
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
                         fetch_us, build_peak, _status_mib("RssAnon"), _status_mib("RssFile"),
                         _peak_mib(resource.RUSAGE_SELF),
                         _peak_mib(resource.RUSAGE_CHILDREN) if num_proc > 1 else None,
                         _tree_mib(cache)))

        shared_rows = [(n, *shared_build_row(data, Path(tmp) / f"shared{n}", args.tokenizer, n))
                       for n in args.sharers]

    lines = [
        f"# Length index benchmark ({args.records:,} short synthetic chats, {size_mb:.1f} MB JSONL)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs visible "
        "(shared with other jobs while measured), Python " + platform.python_version() + ".",
        "Build = parse + validate + chat template + tokenize + write the memory-mapped store.",
        "Cached load = `load_sft_dataset` again (hashes the data file or reuses its remembered "
        "hash, checks the key, maps arrays).",
        "",
        "Memory (run one `--num-proc` per process for a row's own peaks): the main process's "
        "peak RSS when its build returned, and at the end (after the cached loads and 10,000 "
        "`ds[i]` reads spread over the store) with the largest worker's; RSS at the end split "
        "into anonymous memory and file-backed pages (the memory-mapped store's pages that the "
        "reads touched: page cache the kernel can reclaim).",
        "",
        "| num_proc | records | tokens | build s | build records/s | cached load s | "
        "load_length_index + sum s | ds[i] us | peak RSS after build MiB | peak RSS at end MiB "
        "(main / worker) | RSS at end MiB (anon / file) | cache MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p, n, tokens, build, rate, cached, index_only, fetch, build_mib, anon_mib, file_mib, \
            main_mib, worker_mib, cache_mib \
            in rows:
        peak = f"{main_mib:,.0f}" + (f" / {worker_mib:,.0f}" if worker_mib is not None else "")
        lines.append(
            f"| {p} | {n:,} | {tokens:,} | {build:.1f} | {rate:,.0f} | {cached:.3f} | "
            f"{index_only:.4f} | {fetch:.1f} | {build_mib:,.0f} | {peak} | "
            f"{anon_mib:,.0f} / {file_mib:,.0f} | {cache_mib:,.0f} |"
        )
    if shared_rows:
        lines += [
            "",
            "Shared build: that many processes load the file at once with `build_sharers=N` (as a "
            "job's ranks do: each tokenizes parts in one process, one merges), from a common start; "
            "build s is the wall time until the last has the entry.",
            "",
            "| sharers | records | build s | build records/s | parts | parts per process | "
            "peak RSS MiB per process | cache MiB |",
            "|---:|---:|---:|---:|---:|---|---|---:|",
        ]
        for n, records, wall, parts, here, peaks, cache_mib in shared_rows:
            lines.append(f"| {n} | {records:,} | {wall:.1f} | {records / wall:,.0f} | {parts} | "
                         f"{' / '.join(map(str, here))} | "
                         f"{' / '.join(f'{p:,.0f}' for p in peaks)} | {cache_mib:,.0f} |")
    command = "python benchmarks/bench_length_index.py " + " ".join(argv or sys.argv[1:])
    text = f"Command: `{command}`\n\n" + "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return text


if __name__ == "__main__":
    main()
