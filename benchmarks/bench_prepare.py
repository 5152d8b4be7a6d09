"""Time ``megatron-packing prepare`` on the demo chats replicated to ~20k examples.

Runs the command in-process (``megatron_packing.cli.main``) with each ``--workers`` count into
its own cache directory, then once more on the built cache (the load a job makes), and checks
that the worker counts wrote byte-identical caches. Prints a Markdown table (``--out`` writes
it). This is a measurement, not a test.

    python benchmarks/bench_prepare.py --out benchmarks/results/bench_prepare.md
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def cache_bytes(cache: Path) -> dict[str, bytes]:
    """The cache entries' files (not their locks or the file-hash memos), by relative path."""
    return {str(p.relative_to(cache)): p.read_bytes() for p in sorted(cache.glob("*/*"))}


def write_config(path: Path, data: Path, cache: Path) -> Path:
    """A packing YAML's ``data:`` section for ``data`` with the shipped tokenizer."""
    path.write_text(f"data:\n  paths: [{data}]\n  tokenizer: {ROOT / 'examples' / 'tokenizer'}\n"
                    f"  cache_dir: {cache}\n")
    return path


def timed_prepare(config: Path, workers: int) -> tuple[float, str]:
    from megatron_packing.cli import main as cli_main

    out = io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stdout(out):
        code = cli_main(["prepare", "--config", str(config), "--workers", str(workers)])
    if code != 0:
        raise SystemExit(f"prepare failed ({code}):\n{out.getvalue()}")
    return time.perf_counter() - started, out.getvalue()


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=20_000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    lines_in = (ROOT / "examples" / "data" / "demo_chat.jsonl").read_text().splitlines(True)
    rows, caches = [], []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "demo_20k.jsonl"
        copies = -(-args.examples // len(lines_in))
        data.write_text("".join((lines_in * copies)[: args.examples]))
        size_mb = data.stat().st_size / 1e6
        warm = Path(tmp) / "warm.jsonl"  # the imports and the first tokenizer load, untimed
        warm.write_text("".join(lines_in[:50]))
        timed_prepare(write_config(Path(tmp) / "warm.yaml", warm, Path(tmp) / "warm_cache"), 1)
        for workers in args.workers:
            cache = Path(tmp) / f"cache{workers}"
            config = write_config(Path(tmp) / f"sft{workers}.yaml", data, cache)
            build, report = timed_prepare(config, workers)
            assert "(built)" in report, report
            present, report = timed_prepare(config, workers)
            assert "(already present)" in report, report
            tokens = next(line.split()[-1] for line in report.splitlines()
                          if line.strip().startswith("tokens"))
            rows.append((workers, int(tokens), build, present))
            caches.append(cache_bytes(cache))
        identical = all(c == caches[0] for c in caches[1:])

    head = [
        f"# `megatron-packing prepare` build time ({args.examples:,} demo chats, "
        f"{size_mb:.1f} MB JSONL)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs visible "
        "(shared with other jobs while measured), Python " + platform.python_version() + ".",
        "Build = the whole command on an empty cache_dir (read the YAML, load the tokenizer, "
        "hash, parse, tokenize, write the store); present = the command again (the load a job "
        "makes: hash or remembered hash, key, checksums, memory map).",
        f"Caches byte-identical across worker counts: {'yes' if identical else 'NO'}.",
        "",
        "| workers | examples | tokens | build s | examples/s | present s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    body = [f"| {w} | {args.examples:,} | {t:,} | {b:.2f} | {args.examples / b:,.0f} | {p:.2f} |"
            for w, t, b, p in rows]
    text = "\n".join(head + body) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return text


if __name__ == "__main__":
    main()
