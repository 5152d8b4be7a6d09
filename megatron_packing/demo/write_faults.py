"""A write the OS refuses ends the run with one message: the path, the OS error, and the last
complete checkpoint, which stays intact.

Permission, a read-only file system, a full disk, a quota or the file-size limit (``ulimit -f``:
Python ignores SIGXFSZ, so the write fails with EFBIG) can stop any write of a run: the run lock,
the metrics, a checkpoint. `WriteFault` is that fault. The launcher prints its message alone with
exit code 1 (a fault of the machine, not of the input); a rank reports it the same way. What
third-party writers said on the way (megatron-core's ``torch_dist`` writer logs an error per
helper process, torch raises a ``CheckpointException`` carrying every rank's traceback) goes to
a log file that the message names (`keep_log`), not to the screen.

torch's C++ file writer reports a failed write without its errno (``unexpected pos 704 vs
598``); when no OS error is found in the exception (`find_write_error`), `probe_write`
reproduces it in the directory the writer was filling.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

WRITE_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT,
                          errno.EFBIG})
"""The OS errors of a refused write: permission, read-only file system, no space, quota,
file-size limit."""
_ONLY_WRITES = frozenset({errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
LOG_DIR = "logs"


class WriteFault(RuntimeError):
    """The OS refused a write of the run; the message names the path, the OS error and the last
    complete checkpoint (and the log file that holds the writers' own messages, if any)."""


def is_write_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an OS error of a refused write.

    A permission error is one only where the path is readable or does not exist yet (it was to
    be created): a file that cannot be read is a read error.
    """
    if not isinstance(exc, OSError) or exc.errno not in WRITE_ERRNOS:
        return False
    if exc.errno in _ONLY_WRITES or not isinstance(exc.filename, (str, os.PathLike)):
        return exc.errno in _ONLY_WRITES
    path = os.fspath(exc.filename)
    return not os.path.exists(path) or os.access(path, os.R_OK)


def find_write_error(exc: BaseException) -> OSError | None:
    """The refused write's OS error in ``exc``: itself, its cause or context, or one of the
    per-rank failures a torch distributed checkpoint carries (``CheckpointException.failures``)."""
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if is_write_error(current):
            assert isinstance(current, OSError)
            return current
        pending += [e for e in (current.__cause__, current.__context__) if e is not None]
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():
                inner = failure[0] if isinstance(failure, tuple) and failure else failure
                if isinstance(inner, BaseException):
                    pending.append(inner)
    return None


def probe_write(directory: Path) -> OSError | None:
    """The OS error a write into ``directory`` meets now, or None when the OS accepts it.

    Writes 64 KiB to a scratch file and syncs it (permission, read-only, no space, quota). A
    file-size limit counts where a file under ``directory`` already reached it (a writer stopped
    there): one byte written at the limit meets EFBIG.
    """
    probe = directory / f".write-probe-{os.getpid()}"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    reached = _file_at(directory, limit) if limit != resource.RLIM_INFINITY else None
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"\0" * 65536)
            os.fsync(fd)
            if reached is not None:
                os.pwrite(fd, b"\0", limit)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as exc:
        exc.filename = str(directory)
        return exc
    return None


def _file_at(directory: Path, limit: int) -> Path | None:
    """A file under ``directory`` of ``limit`` bytes or more."""
    try:
        return next((p for p in sorted(directory.rglob("*"))
                     if p.is_file() and p.stat().st_size >= limit), None)
    except OSError:
        return None


def failed_path(error: OSError, directory: Path) -> Path:
    """Where under ``directory`` a writer's ``error`` happened: the file it names, else the file
    that reached the file-size limit (EFBIG), else ``directory``."""
    named = Path(error.filename) if isinstance(error.filename, str) else directory
    if named != directory and named.is_relative_to(directory):
        return named
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if error.errno == errno.EFBIG and limit != resource.RLIM_INFINITY:
        return _file_at(directory, limit) or directory
    return directory


def describe(path: str | os.PathLike[str], error: OSError) -> str:
    """``cannot write <path>: [Errno 28] No space left on device``."""
    code = error.errno if error.errno is not None else 0
    return f"cannot write {os.fspath(path)}: [Errno {code}] {os.strerror(code)}"


def checkpoint_note(output_dir: str | Path) -> str:
    """What a failed write left: the last complete checkpoint, intact, or none yet."""
    from megatron_packing.demo.checkpoint import complete_checkpoints

    if not Path(output_dir).is_dir():
        return f"{output_dir} could not be created: nothing was written"
    try:
        complete = complete_checkpoints(output_dir)
    except OSError:
        complete = []
    if not complete:
        return f"{output_dir} holds no complete checkpoint yet"
    return (f"the last complete checkpoint {complete[-1]} is intact (--resume continues from it "
            "once the fault is fixed)")


def keep_log(output_dir: str | Path, rank: int, text: str) -> Path | None:
    """Append ``text`` to the run's fault log, ``<output_dir>/logs/write_faults.rankN.log``,
    or, where that cannot be written (the fault itself), to the same name in the temporary
    directory; the path written, None when neither could be."""
    name = f"write_faults.rank{rank}.log"
    tag = f"{Path(output_dir).resolve().name}-" if Path(output_dir).name else ""
    data = (text.rstrip("\n") + "\n").encode()
    for path in (Path(output_dir) / LOG_DIR / name,
                 Path(tempfile.gettempdir()) / f"megatron-packing-{tag}{name}"):
        existed = path.exists()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "ab") as f:
                f.write(data)
            return path
        except OSError:
            if not existed:  # no empty or cut log left behind
                with contextlib.suppress(OSError):
                    path.unlink()
    return None


def fault_message(path: str | os.PathLike[str], error: OSError, output_dir: str | Path) -> str:
    """One line: the path, the OS error and the last complete checkpoint."""
    return f"{describe(path, error)}; {checkpoint_note(output_dir)}"


@contextmanager
def naming(path: str | os.PathLike[str]) -> Iterator[None]:
    """Give an OS error raised in the block without a path (a failed ``write`` or ``flush``
    names none) the path of the file being written."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            exc.filename = os.fspath(path)
        raise


@contextmanager
def write_faults_named(output_dirs: list[str]) -> Iterator[None]:
    """Turn a refused write in the block into a `WriteFault` naming the output directory (of
    ``output_dirs``) that holds the path, or the first."""
    try:
        yield
    except OSError as exc:
        if not is_write_error(exc):
            raise
        path = os.fspath(exc.filename) if exc.filename is not None else output_dirs[0]
        output_dir = next((d for d in output_dirs
                           if Path(path).resolve().is_relative_to(Path(d).resolve())),
                          output_dirs[0])
        raise WriteFault(fault_message(path, exc, output_dir)) from None


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@contextmanager
def collected_log_records() -> Iterator[list[str]]:
    """While the block runs, what loggers say (WARNING and above, through the root logger) is
    collected instead of shown; the caller shows it (`show`) or keeps it in the fault log."""
    root = logging.getLogger()
    collect = _Collect()
    saved = root.handlers[:]
    root.handlers = [collect]
    try:
        yield collect.lines
    finally:
        root.handlers = saved


def show(lines: list[str]) -> None:
    """Print collected log lines as Python's last-resort handler would have (stderr)."""
    for line in lines:
        print(line, file=sys.stderr, flush=True)


__all__ = ["WRITE_ERRNOS", "WriteFault", "checkpoint_note", "collected_log_records", "describe",
           "failed_path", "fault_message", "find_write_error", "is_write_error", "keep_log", "naming",
           "probe_write", "show", "write_faults_named"]
