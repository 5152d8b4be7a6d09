"""Build one length-index cache entry with every process that loads it at once.

A job's ranks all load their data. When the entry is missing, each of them tokenizes parts of
the source instead of one rank building it all while the others wait:

- The source's records are cut into parts of `part_size` records (from the record count and
  the number of sharers, so every process cuts them alike). Part ``p`` is written as a small
  store ``.<entry>-parts-<size>/<p>`` by whichever process takes its file lock first; a
  process skips a part that is written or whose lock another holds, and reads past its records
  without parsing them.
- A second pass waits on the locks of the parts others held (no collective, so no timeout) and
  builds any part whose builder died (the kernel released its lock, the part is not written).
- Then one process, holding the entry's exclusive lock, merges the parts in order into the
  entry: the same files, byte for byte, as a build by one process. The others wait on that
  lock and read the entry. Every sharer holds the entry's lock shared while it builds parts,
  so a process building the entry alone (``prepare``) waits for them, and ``prepare`` sees a
  build in progress.
- In ``error`` mode a bad record raises in the process that meets it; every other process then
  builds that part itself and raises the same error.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import chunk_encoding as encoding
from .build_lock import entry_lock, say, try_lock
from .records import RawItem
from .store import StoreWriter, TokenStore, drop_partial_writes
from .tokenize import ChatEncoder

MIN_PART_RECORDS = 256
MAX_PART_RECORDS = 65_536
PARTS_PER_SHARER = 4  # more parts than sharers, so one slow process does not hold the rest up
MERGE_EXAMPLES = 8192  # examples copied per write while merging (bounds the merge's memory)


def part_size(total: int, sharers: int) -> int:
    """Records per part for a source of ``total`` records built by ``sharers`` processes."""
    want = math.ceil(max(total, 1) / (PARTS_PER_SHARER * max(sharers, 1)))
    return min(max(want, MIN_PART_RECORDS), MAX_PART_RECORDS)


@dataclass
class SharedBuild:
    """One entry to build with the other processes that load it."""

    final: Path
    lock: Path  # the entry's lock file
    source: str
    open_items: Callable[[], Iterable[RawItem]]
    total: int | None  # records the source holds (a line count may count blank lines too)
    raw_is_text: bool
    encoder: ChatEncoder
    on_bad_record: str
    meta: dict[str, Any]  # the entry's meta, less what the tally adds
    sharers: int
    num_proc: int | None = None
    show_progress: bool = False
    built_here: list[int] = field(default_factory=list)  # parts this process wrote

    def __post_init__(self) -> None:
        self.size = part_size(self.total or 0, self.sharers)
        self.count = max(1, math.ceil((self.total or 0) / self.size))
        self.parts_dir = self.final.parent / f".{self.final.name}-parts-{self.size}"

    def part_path(self, part: int) -> Path:
        return self.parts_dir / f"{part:06d}"

    def part_done(self, part: int) -> bool:
        return (self.part_path(part) / "meta.json").is_file()

    def entry_done(self) -> bool:
        return (self.final / "meta.json").is_file()


def build_shared(build: SharedBuild) -> TokenStore:
    """The entry, built with the other sharers or read once one of them has merged it."""
    began = time.monotonic()
    with entry_lock(build.lock, what=f"the length index of {build.source}", shared=True):
        if not build.entry_done():
            say(f"building the length index of {build.source} with the other processes that "
                f"load it: {build.count} parts of {build.size} records in {build.parts_dir}")
            bar = _PartsBar(build)
            try:
                if _build_parts(build, bar, wait=False):
                    _build_parts(build, bar, wait=True)
            finally:
                bar.close()
    with entry_lock(build.lock, what=f"the length index of {build.source}"):
        if build.entry_done():
            store = TokenStore(build.final)
            merged = "another process merged it"
        else:
            store = _merge(build)
            merged = "merged here"
    say(f"the length index of {build.source} is built ({len(build.built_here)} of "
        f"{build.count} parts tokenized here, {merged}, {time.monotonic() - began:.0f} s); "
        f"loading {build.final}")
    return store


class _PartsBar:
    """A progress bar over the entry's parts, each counted once when it is written (here or
    by another process)."""

    def __init__(self, build: SharedBuild) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=build.count, unit="part", disable=not build.show_progress,
                        desc=f"tokenizing {Path(build.source).name} (shared)")
        self.done: set[int] = set()

    def seen(self, part: int) -> None:
        if part not in self.done:
            self.done.add(part)
            self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _build_parts(build: SharedBuild, bar: _PartsBar, *, wait: bool) -> bool:
    """One pass over the source: build each part not written yet whose lock is free (or, with
    ``wait``, once its holder lets go); True when some part was left to another process."""
    num_proc = build.num_proc
    if num_proc is None:
        per_host = int(os.environ.get("LOCAL_WORLD_SIZE", build.sharers))
        num_proc = encoding.default_num_proc(build.total, per_host)
    left = False
    records = iter(build.open_items())
    for part in range(build.count):
        these = itertools.islice(records, build.size)
        if build.part_done(part):
            deque(these, maxlen=0)
            bar.seen(part)
            continue
        lock = build.parts_dir / f"{part:06d}.lock"
        if wait:
            with entry_lock(lock, what=f"part {part + 1} of {build.count} of the length index "
                                       f"of {build.source}"):
                if not build.part_done(part):
                    _build_part(build, part, these, num_proc)
        else:
            with try_lock(lock) as held:
                if held and not build.part_done(part):
                    _build_part(build, part, these, num_proc)
                left = left or not held
        deque(these, maxlen=0)
        if build.part_done(part):
            bar.seen(part)
    extra = next(records, None)
    if extra is not None:
        raise RuntimeError(f"{build.source}: more records than the {build.total} counted "
                           f"(record at line {extra[0]}); was the file written to during the "
                           "build?")
    return left


def _build_part(build: SharedBuild, part: int, items: Iterator[RawItem], num_proc: int) -> None:
    """Tokenize one part's records into its store (this process holds the part's lock)."""
    final = build.part_path(part)
    drop_partial_writes(final)
    tally = encoding.SkipTally(build.source, build.on_bad_record)
    writer = StoreWriter(final)
    try:
        for _, res in encoding.ordered_results(items, build.raw_is_text, build.encoder, num_proc):
            tally.add(res)
            writer.append(res.ids, res.mask, res.lengths, res.lines)
    except BaseException:
        writer.abort()
        raise
    writer.commit({"kind": "cache-part", "part": part, "parts": build.count,
                   "builder": {"pid": os.getpid(), "rank": os.environ.get("RANK")},
                   **tally.meta()})
    build.built_here.append(part)


def _merge(build: SharedBuild) -> TokenStore:
    """Concatenate the parts, in order, into the entry (this process holds the entry's lock),
    then remove every parts directory of the entry."""
    drop_partial_writes(build.final)
    missing = [p for p in range(build.count) if not build.part_done(p)]
    if missing:
        raise RuntimeError(f"{build.parts_dir}: part(s) {missing[:5]} of the length index of "
                           f"{build.source} are not written although no process holds their "
                           "locks; delete the directory and load again")
    tally = encoding.SkipTally(build.source, build.on_bad_record)
    writer = StoreWriter(build.final)
    try:
        for p in range(build.count):
            part = TokenStore(build.part_path(p))
            tally.add_recorded(part.meta)
            for start in range(0, len(part), MERGE_EXAMPLES):
                stop = min(start + MERGE_EXAMPLES, len(part))
                a, b = int(part.offsets[start]), int(part.offsets[stop])
                ids, mask = part.token_span(a, b)
                writer.append(ids, mask, part.lengths[start:stop], part.record_lines[start:stop])
    except BaseException:
        writer.abort()
        raise
    store = writer.commit({**build.meta, **tally.meta()})
    for stale in build.final.parent.glob(f".{build.final.name}-parts-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return store


__all__ = ["MAX_PART_RECORDS", "MIN_PART_RECORDS", "SharedBuild", "build_shared", "part_size"]
