"""File locks on length-index cache entries and their parts, and how a process waits on one.

Every rank of a job loads its data itself. Building a missing entry is coordinated only through
``fcntl.flock`` locks on files in the cache directory (`shared_build` for a build shared by a
job's ranks, `length_index.build_or_load` for a process building alone): no collective, so no
process-group timeout. A process that has to wait on a lock prints one line when it starts and
one every `PROGRESS_INTERVAL_S` seconds: what it waits for, the lock file, who holds it, how long
so far. The kernel releases a flock when its holder dies, so a builder that is killed does not
leave the others hanging: the next waiter takes the lock, finds the work unfinished and does it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

PROGRESS_INTERVAL_S = 30.0
POLL_S = 0.2  # how often a waiter tries the lock again


def say(message: str) -> None:
    """One line on stderr, tagged with the global rank when there is one."""
    rank = os.environ.get("RANK")
    where = f" [rank {rank}]" if rank is not None else ""
    print(f"megatron_packing{where}: {message}", file=sys.stderr, flush=True)


@dataclass
class LockWait:
    """How a process came to hold an entry's lock."""

    waited: bool = False  # another process held it when this one asked
    seconds: float = 0.0
    holder: str = ""  # who held it (as that process wrote it into the lock file)


def describe_holder(path: Path) -> str:
    """``pid P on host H (rank R)`` as the holder wrote it into the lock file, else ``""``."""
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return ""
    if not isinstance(info, dict) or "pid" not in info:
        return ""
    rank = f" (rank {info['rank']})" if info.get("rank") is not None else ""
    return f"pid {info['pid']} on host {info.get('host', '?')}{rank}"


@contextlib.contextmanager
def entry_lock(path: Path, *, what: str, interval: float | None = None,
               report: Callable[[str], None] | None = None,
               shared: bool = False) -> Iterator[LockWait]:
    """Hold ``path``'s exclusive flock for the block, waiting (with progress lines) while
    another process holds it. ``what`` names the awaited thing in the lines; ``interval`` is
    the seconds between them (default `PROGRESS_INTERVAL_S`); ``report`` prints a line
    (default `say`). ``shared`` takes a shared flock instead, which many processes hold at
    once and which an exclusive holder excludes; a shared holder writes no holder record."""
    report = say if report is None else report
    every = PROGRESS_INTERVAL_S if interval is None else interval
    kind = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as f:
        wait = LockWait()
        try:
            fcntl.flock(f, kind | fcntl.LOCK_NB)
        except BlockingIOError:
            wait.waited = True
            wait.holder = describe_holder(path)
            held_by = f", held by {wait.holder}" if wait.holder else ""
            report(f"waiting for {what}: another process builds it and holds the lock "
                   f"{path}{held_by}; no collective is involved, so this wait has no timeout. "
                   "If that process dies, the lock is released and a waiting process builds "
                   "the entry itself")
            started = last = time.monotonic()
            while True:
                time.sleep(POLL_S)
                try:
                    fcntl.flock(f, kind | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    now = time.monotonic()
                    if now - last >= every:
                        last = now
                        report(f"still waiting for {what}: lock {path}{held_by}, "
                               f"{now - started:.0f} s so far")
            wait.seconds = time.monotonic() - started
        try:
            if not shared:
                _write_holder(f)
            yield wait
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def try_lock(path: Path) -> Iterator[bool]:
    """Hold ``path``'s exclusive flock for the block if no other process holds it (yields
    True), else yield False at once, holding nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            _write_holder(f)
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write_holder(f: IO[str]) -> None:
    """Record this process in the lock file it holds exclusively (read by `describe_holder`)."""
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                        "rank": os.environ.get("RANK")}))
    f.flush()


__all__ = ["PROGRESS_INTERVAL_S", "LockWait", "describe_holder", "entry_lock", "say", "try_lock"]
