"""``megatron-packing prepare``: build (or verify) a config's length-index cache ahead of the job.

A job that tokenizes a few million examples at start-up can run past the collective timeout
before its first step. ``prepare`` builds the cache entries of ``data.paths`` and
``data.valid_paths`` offline, through `load_data_split`, the very call the demo trainer and the
Megatron-LM entry point make, so the job then finds every entry under the same key and only
memory-maps it. An entry already there is loaded, which checks its checksums.

A build of the same entry by another process holds a file lock (`build_or_load`); ``prepare``
says so, naming the lock file, and then waits for it (the entry is then loaded, not rebuilt).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatron_packing.config import ConfigError
from megatron_packing.config.data_loading import load_data_split
from megatron_packing.config.sections import read_sections
from megatron_packing.config.training import DataConfig
from megatron_packing.data import default_cache_dir
from megatron_packing.data.length_index import held_locks

from .progress import progress_enabled

_SPLITS = (("train", "paths"), ("valid", "valid_paths"))


class PrepareError(Exception):
    """The data could not be loaded (an unreadable file or tokenizer); the message says which."""


@dataclass
class SplitReport:
    """What ``prepare`` found for one split: the dataset's figures and its cache entries."""

    split: str
    key: str
    examples: int
    tokens: int
    loss_tokens: int
    skipped: dict[str, int]
    entries: list[tuple[str, str]]  # (directory, "built" | "already present" | "pre-tokenized")
    seconds: float


def read_data_config(path: str) -> tuple[DataConfig, Any]:
    """The ``data:`` section of a demo-trainer YAML or of a Megatron-LM ``--packing-config``
    YAML, read as every command reads a training YAML (`config.sections`), with the function
    that resolves its paths (as ``train`` resolves them)."""
    sections = read_sections(path, command="megatron-packing prepare")
    if sections.training is not None:
        return sections.data, sections.training.resolve
    return sections.data, str


def _check_inputs(data: DataConfig, resolve: Any, source: str) -> None:
    if not data.cache_dir:
        raise ConfigError(
            f"{source}: data.cache_dir is not set, so there is nothing to prepare ahead of the "
            f"job: without it the job builds its length index at start-up in the default cache "
            f"directory of the machine and user that run it ($MEGATRON_PACKING_CACHE, else "
            f"~/.cache/megatron_packing/sft; here {default_cache_dir()}), which a build made here "
            "is not sure to be; set data.cache_dir to a directory the job's nodes share")
    for _, key in _SPLITS:
        for i, p in enumerate(getattr(data, key)):
            if not Path(resolve(p)).exists():
                raise ConfigError(f"{source}: data.{key}[{i}] {resolve(p)!r} does not exist")
    if not Path(resolve(data.tokenizer)).is_dir():
        raise ConfigError(f"{source}: data.tokenizer {resolve(data.tokenizer)!r} is not a "
                          "tokenizer directory")


def _cache_entries(cache: Path) -> set[Path]:
    return {p.parent.resolve() for p in cache.glob("*/meta.json")}


def _warn_held_locks(cache: Path, paths: list[str]) -> None:
    for p in paths:
        for lock in held_locks(cache, Path(p).name):
            print(f"megatron-packing prepare: another build holds the lock {lock}; waiting for "
                  "it to finish (its entry is then loaded, not built again)",
                  file=sys.stderr, flush=True)


def prepare_split(data: DataConfig, resolve: Any, split: str, key: str,
                  workers: int) -> SplitReport:
    """Build or load one split's cache entries and measure them."""
    paths: list[str] = list(getattr(data, key))
    assert data.cache_dir
    cache = Path(resolve(data.cache_dir))
    _warn_held_locks(cache, [resolve(p) for p in paths])
    before = _cache_entries(cache)
    started = time.perf_counter()
    try:
        ds = load_data_split(data, paths, resolve=resolve, num_proc=workers,
                             show_progress=progress_enabled())
    except (ValueError, OSError) as exc:  # an unreadable data file or tokenizer
        raise PrepareError(f"cannot load data.{key} ({', '.join(paths)}): {exc}") from None
    seconds = time.perf_counter() - started
    entries = []
    for index in ds.index_paths:
        where = Path(index).resolve()
        state = ("pre-tokenized" if where.parent != cache.resolve()
                 else "already present" if where in before else "built")
        entries.append((str(index), state))
    return SplitReport(split, key, len(ds), ds.num_tokens,
                       int(np.asarray(ds.loss_token_counts, dtype=np.int64).sum()),
                       dict(sorted(ds.skipped.items())), entries, seconds)


def format_split(report: SplitReport, workers: int) -> str:
    skipped = (f"{sum(report.skipped.values())} ("
               + ", ".join(f"{r}={n}" for r, n in report.skipped.items()) + ")"
               if report.skipped else "0")
    lines = [f"{report.split} (data.{report.key}):",
             f"  examples      {report.examples}",
             f"  tokens        {report.tokens}",
             f"  loss tokens   {report.loss_tokens}",
             f"  skipped       {skipped}"]
    lines += [f"  cache         {path} ({state})" for path, state in report.entries]
    lines.append(f"  time          {report.seconds:.2f} s ({workers} worker"
                 f"{'s' if workers > 1 else ''})")
    return "\n".join(lines)


def prepare_command(config: str, workers: int) -> int:
    """Build or verify every split's cache entries and print what each holds; exit status 0."""
    data, resolve = read_data_config(config)
    _check_inputs(data, resolve, config)
    for split, key in _SPLITS:
        if not getattr(data, key):
            print(f"{split} (data.{key}): none in {config}")
            continue
        print(format_split(prepare_split(data, resolve, split, key, workers), workers),
              flush=True)
    print("the job's loader (train, or the Megatron-LM entry point with --packing-config) "
          "loads these entries without tokenizing")
    return 0
