"""One training run per output directory: an exclusive ``flock`` on ``<dir>/.run.lock``.

The lock file holds the holder's pid, for the refusal message. The kernel drops an flock when
its holder dies (even by kill -9), so a stale lock never blocks a later run.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from megatron_packing.demo.write_faults import naming

LOCK_FILE = ".run.lock"


class OutputDirInUse(RuntimeError):
    """Another live process holds the output directory's lock."""


@contextmanager
def hold_output_dir(directory: str | Path) -> Iterator[Path]:
    """Hold ``directory``'s run lock for the ``with`` block, or raise `OutputDirInUse`."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise OutputDirInUse(f"output directory {directory} is a file, not a directory; pick "
                             "another --output-dir")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise OutputDirInUse(
            f"output directory {directory} is in use by another training run (pid {holder}, "
            f"lock file {path}); wait for it to end or stop it, or pick another --output-dir"
        ) from None
    try:
        with naming(path):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield path
    finally:
        os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


@contextmanager
def hold_output_dirs(directories: list[str]) -> Iterator[None]:
    """`hold_output_dir` for each distinct directory (in sorted order)."""
    with ExitStack() as stack:
        for directory in sorted({str(Path(d).resolve()) for d in directories}):
            stack.enter_context(hold_output_dir(directory))
        yield
