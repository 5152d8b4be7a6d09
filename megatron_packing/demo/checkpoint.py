"""Checkpoints written atomically, checked on resume, the newest N kept.

Layout::

    <dir>/checkpoints/step_000020/weights/...     model and optimizer (`demo.weights`)
                                  rank0.pt, rank1.pt, manifest.json
    <dir>/checkpoints/latest            "step_000020"

A save goes to ``step_000020.partial/``: the ranks together write the sharded model and
optimizer into ``weights/`` (a distributed checkpoint), every rank writes its own file (the LR
schedule and the loader state: temp name, fsync, rename), rank 0 then writes ``manifest.json``
(every file's size and sha256, the distributed checkpoint's included), renames the directory
to ``step_000020`` and only then points ``latest`` at it. A run killed mid-save leaves a
``.partial`` directory that resume ignores (and says so); ``latest`` still names the previous
complete checkpoint. A checkpoint whose files do not match their manifest (truncated, damaged)
is refused by name. A write the OS refuses (permission, read-only, disk full, file-size limit)
removes the partial directory and raises `WriteFault` on every rank, naming the path, the OS
error and the last complete checkpoint, which stays as it was; what the writers said is kept in
a log file (`demo.write_faults`). Any other failed write raises `CheckpointError`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_packing.demo import write_faults

LATEST = "latest"
MANIFEST = "manifest.json"
PARTIAL_SUFFIX = ".partial"
SHARED = "weights"
"""The subdirectory that the ranks' collective writer (`save_checkpoint`'s ``write_shared``)
fills: the distributed checkpoint of the model and optimizer."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or one on disk cannot be resumed from."""


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def _write_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (the one place checkpoint bytes hit the disk)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        _write_file(tmp, data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _gather(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _write_failure(exc: OSError, path: Path) -> dict[str, Any]:
    """A failed write of this rank's own file, for the outcome the ranks share."""
    if write_faults.is_write_error(exc):
        return {"error": write_faults.describe(path, exc), "fault": True}
    return {"error": f"could not write {path}: {exc}"}


def _shared_write_failure(exc: BaseException, directory: Path) -> dict[str, Any]:
    """A failed collective write into ``directory``: the OS error that stopped it, found in the
    exception or else reproduced by a probe write (before the partial files are removed)."""
    cause = write_faults.find_write_error(exc) or write_faults.probe_write(directory)
    if cause is not None:
        where = write_faults.failed_path(cause, directory)
        return {"error": write_faults.describe(where, cause), "fault": True}
    text = str(exc).strip()
    return {"error": f"could not write {directory}: {type(exc).__name__}: "
                     f"{text.splitlines()[0][:300] if text else ''}"}


def _shared_files(directory: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file under ``directory``, by its path in the checkpoint."""
    found = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        data = path.read_bytes()
        found[path.relative_to(directory.parent).as_posix()] = {"bytes": len(data),
                                                                "sha256": _sha256(data)}
    return found


def save_checkpoint(output_dir: str | Path, step: int, rank: int, state: dict[str, Any], *,
                    keep: int = 3, setup: dict[str, Any] | None = None,
                    write_shared: Callable[[Path], None] | None = None) -> Path:
    """Write this rank's state for ``step``; once every rank wrote, publish it as latest.

    ``setup`` (JSON values) goes into the manifest: what a resume must not change
    (`check_setup` compares it before any rank starts). ``write_shared`` (collective, called
    on every rank with the same empty directory, ``<checkpoint>/weights``) writes what the ranks
    save together; its files are in the manifest like the rank files.

    Collective when a process group is initialised: every rank must call it for the same step.
    If any rank's write failed, nothing is published and every rank raises: `WriteFault` when
    the OS refused a write (the writers' messages and tracebacks go to the fault log the message
    names), else `CheckpointError`.
    """
    root = checkpoint_root(output_dir)
    final = root / step_dir_name(step)
    partial = root / (final.name + PARTIAL_SUFFIX)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by an earlier interrupted save
        partial.mkdir(parents=True)
        if write_shared is not None:
            (partial / SHARED).mkdir()
    _barrier()
    path = partial / f"rank{rank}.pt"
    outcome: dict[str, Any] = {"rank": rank}
    details = ""  # what the writers said and the failure's traceback, for the fault log
    if write_shared is not None:
        failure: BaseException | None = None
        with write_faults.collected_log_records() as said:
            try:
                write_shared(partial / SHARED)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # torch's CheckpointException is a BaseException
                failure = exc
        if failure is None:
            write_faults.show(said)
        else:
            outcome.update(_shared_write_failure(failure, partial / SHARED))
            details = "\n".join([*said, "".join(traceback.format_exception(failure))])
    buffer = io.BytesIO()
    torch.save({**state, "step": step}, buffer)
    data = buffer.getvalue()
    if "error" not in outcome:
        try:
            _write_atomic(path, data)
            outcome.update(file=path.name, bytes=len(data), sha256=_sha256(data))
        except OSError as exc:
            outcome.update(_write_failure(exc, path))
    outcomes = _gather(outcome)
    errors = list(dict.fromkeys(o["error"] for o in outcomes if "error" in o))
    if errors:
        _barrier()
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        _barrier()  # the partial files are gone: a full disk has room for the fault log again
        log = write_faults.keep_log(output_dir, rank, details) if details else None
        logs = sorted({str(p) for p in _gather(log) if p is not None})
        message = (f"checkpoint of step {step} failed: {'; '.join(errors)}; nothing was "
                   f"published and {write_faults.checkpoint_note(output_dir)}")
        if logs:
            message += f"; the writers' messages and tracebacks are in {', '.join(logs)}"
        if any(o.get("fault") for o in outcomes):
            raise write_faults.WriteFault(message)
        raise CheckpointError(message)
    if rank == 0:
        files = {o["file"]: {"bytes": o["bytes"], "sha256": o["sha256"]} for o in outcomes}
        if write_shared is not None:
            files.update(_shared_files(partial / SHARED))
        manifest = {"step": step, "world_size": len(outcomes), "files": files}
        if setup is not None:
            manifest["setup"] = setup
        _write_atomic(partial / MANIFEST, json.dumps(manifest, indent=1).encode())
        _fsync_dir(partial)
        if final.exists():  # a re-run of the same step (e.g. after a resume) replaces it
            shutil.rmtree(final)
        os.replace(partial, final)
        _fsync_dir(root)
        _write_atomic(root / LATEST, f"{final.name}\n".encode())
        _fsync_dir(root)
        prune_checkpoints(output_dir, keep=keep)
    _barrier()
    return final / path.name


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Checkpoint directories with a manifest, oldest first (by step)."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(PARTIAL_SUFFIX)
             and (p / MANIFEST).exists()]
    return sorted(found, key=lambda p: p.name)


def prune_checkpoints(output_dir: str | Path, *, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints; return what was deleted."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    old = complete_checkpoints(output_dir)[:-keep]
    for path in old:
        shutil.rmtree(path)
    return old


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The directory ``latest`` names, or None when nothing was published yet."""
    marker = checkpoint_root(output_dir) / LATEST
    if not marker.exists():
        return None
    return checkpoint_root(output_dir) / marker.read_text().strip()


def resume_checkpoint(output_dir: str | Path) -> tuple[Path | None, str | None]:
    """The checkpoint a resume takes, and a note when ``latest`` did not decide it.

    The newest complete checkpoint (by step) wins: ``latest`` may be missing, or name an older
    one (a run stopped between publishing a checkpoint and moving the pointer). Cheap (no file
    is read but the pointer); `find_resume_checkpoint` verifies the choice.
    """
    complete = complete_checkpoints(output_dir)
    newest = complete[-1] if complete else None
    pointed = latest_checkpoint(output_dir)
    if (pointed is not None and pointed.is_dir() and pointed not in complete
            and (newest is None or newest.name < pointed.name)):
        return pointed, None  # the newest save is incomplete: verify_checkpoint says how
    if newest is None:
        return None, None
    if pointed == newest:
        return newest, None
    if pointed is None:
        why = f"{checkpoint_root(output_dir) / LATEST} is missing"
    elif not pointed.is_dir():
        why = f"{checkpoint_root(output_dir) / LATEST} names {pointed.name}, which does not exist"
    else:
        why = f"{checkpoint_root(output_dir) / LATEST} names the older {pointed.name}"
    return newest, f"{why}; resuming from the newest complete checkpoint {newest}"


def find_resume_checkpoint(output_dir: str | Path, world_size: int) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from, fully verified, plus notes to print.

    Raises `CheckpointError` naming the file when the chosen checkpoint is incomplete or
    damaged, or was saved with another number of ranks by a release whose rank files have no
    global part to plan from at this size.
    """
    root = checkpoint_root(output_dir)
    notes = [f"ignoring {p} (a save that never completed)"
             for p in sorted(root.glob(f"step_*{PARTIAL_SUFFIX}"))] if root.is_dir() else []
    chosen, note = resume_checkpoint(output_dir)
    if chosen is None:
        return None, notes
    verify_checkpoint(chosen, world_size)
    if note:
        notes.append(note)
    saved = read_manifest(chosen)["world_size"]
    if saved != world_size:
        notes.append(f"{chosen} was saved by {saved} ranks and this run has {world_size}: the "
                     "next steps are planned at the new size from the saved position, carry and "
                     "drift (every rank reads rank 0's global part)")
    return chosen, notes


def read_manifest(directory: Path) -> dict[str, Any]:
    """A checkpoint's manifest, checked field by field; `CheckpointError` names what is wrong."""
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {directory} is damaged: {MANIFEST} cannot be read "
                              f"({exc})") from None
    problems = []
    if not isinstance(manifest, dict):
        problems.append(f"it holds a {type(manifest).__name__}, not an object")
    else:
        for key, kind in (("step", int), ("world_size", int), ("files", dict)):
            if not isinstance(manifest.get(key), kind) or isinstance(manifest.get(key), bool):
                problems.append(f"{key} is {manifest.get(key)!r}, expected {kind.__name__}")
        for name, entry in (manifest.get("files") or {}).items() \
                if isinstance(manifest.get("files"), dict) else ():
            if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                    and isinstance(entry.get("sha256"), str)):
                problems.append(f"files[{name!r}] is {entry!r}, expected bytes and sha256")
    if problems:
        raise CheckpointError(f"checkpoint {directory} is damaged: its {MANIFEST} "
                              f"{'; '.join(problems)}; delete the checkpoint or start without "
                              "--resume")
    return manifest


def verify_checkpoint(directory: Path, world_size: int) -> None:
    """Every rank file is present with the size and sha256 its manifest records."""
    others = [p.name for p in complete_checkpoints(directory.parent.parent) if p != directory]
    hint = (f"; delete it (and fix {directory.parent / LATEST}) to resume from {others[-1]}, "
            "or start without --resume" if others else "; start without --resume")
    manifest_path = directory / MANIFEST
    if not manifest_path.exists():
        raise CheckpointError(f"checkpoint {directory} is half-written: {MANIFEST} is missing"
                              + hint)
    manifest = read_manifest(directory)
    for name, expected in sorted(manifest["files"].items()):
        path = directory / name
        if not path.exists():
            raise CheckpointError(f"checkpoint {directory} is half-written: {name} is missing"
                                  + hint)
        data = path.read_bytes()
        if len(data) != expected["bytes"] or _sha256(data) != expected["sha256"]:
            raise CheckpointError(
                f"checkpoint {directory} is damaged: {name} has {len(data)} bytes "
                f"(sha256 {_sha256(data)[:12]}), its manifest says {expected['bytes']} bytes "
                f"(sha256 {expected['sha256'][:12]})" + hint)
    if manifest["world_size"] != world_size:
        state = load_checkpoint(directory, 0, manifest["world_size"])
        if "global" not in state.get("dataloader", {}):
            raise CheckpointError(
                f"checkpoint {directory} was saved by {manifest['world_size']} ranks by an "
                "earlier release, whose loader state has no global part to plan from on "
                f"{world_size} ranks: resume with train.dp_size: {manifest['world_size']}")


def check_setup(directory: Path, current: dict[str, Any]) -> None:
    """Refuse to resume under settings that change the math, naming each with both values.

    ``current`` maps a dotted config key (``train.lr``) to its value now; the checkpoint's
    manifest holds the values it was saved with.
    """
    saved = read_manifest(directory).get("setup")
    if not isinstance(saved, dict):
        saved = {}
    differing = [
        f"{key}: saved {saved[key]!r}, now {value!r}" if key in saved
        else f"{key}: not recorded in the checkpoint (saved by an older version), now {value!r}"
        for key, value in current.items() if key not in saved or saved[key] != value
    ]
    if differing:
        raise CheckpointError(
            f"cannot resume from {directory}: it was saved under other settings that change "
            f"the training math ({'; '.join(differing)}); resume with the saved values, or "
            "start a new run with --overwrite (or another --output-dir)")


def load_checkpoint(directory: Path, rank: int, world_size: int) -> dict[str, Any]:
    """The rank file a rank of a ``world_size``-rank run resumes from: its own where the
    checkpoint was saved by as many ranks, else rank 0's (its LR schedule and the stream's
    global part are every rank's)."""
    saved = read_manifest(directory)["world_size"]
    path = directory / f"rank{rank if saved == world_size else 0}.pt"
    if not path.exists():
        raise CheckpointError(f"checkpoint {directory} is half-written: {path.name} is missing")
    return torch.load(path, map_location="cpu", weights_only=False)
