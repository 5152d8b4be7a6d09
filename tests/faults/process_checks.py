"""Helpers of the process-lifetime and write-fault tests: a launch's processes by session, kills,
and file systems that refuse writes (read-only, full, a file-size limit).

A launch starts in a session of its own (``start_new_session``), so every process it causes
keeps that session id, even once reparented to init: listing the session is listing what is
left of the launch. torchrun starts each worker in a session of its own too; those sessions are
collected while the launch runs (`sessions_below`).
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .run_faults_helpers import cli_env, tiny_config, train_command, wait_gone, write_config


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, pgrp, session, ...)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def session_processes(sessions: set[int]) -> list[tuple[int, int, str]]:
    """(pid, parent pid, command line) of every live process in one of ``sessions``."""
    assert sessions and not sessions & {0, 1}, sessions
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat(int(entry.name))
        if fields is not None and fields[0] != "Z" and int(fields[3]) in sessions:
            found.append((int(entry.name), int(fields[1]), command_line(int(entry.name))))
    return sorted(found)


def sessions_below(pid: int) -> set[int]:
    """The session ids of ``pid`` and of every process below it that leads its own session."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, frontier = {pid}, [pid]
    while frontier:
        for child in children.get(frontier.pop(), []):
            fields = _stat(child)
            if fields is not None and int(fields[3]) == child:
                found.add(child)
            frontier.append(child)
    return found


def left_after(sessions: set[int], timeout: float = 8.0) -> list[tuple[int, int, str]]:
    """What of ``sessions`` still lives after ``timeout`` seconds (empty as soon as nothing)."""
    deadline = time.monotonic() + timeout
    while (left := session_processes(sessions)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def kill_sessions(sessions: set[int]) -> None:
    """SIGKILL whatever a test left of its own launches' sessions."""
    for pid, _, _ in session_processes(sessions):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_until(condition: Callable[[], bool], proc: subprocess.Popen, log: Path,
               timeout: float = 180, what: str = "") -> None:
    """Poll ``condition`` every 10 ms until it holds; fail if the run ends first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"run ended (rc {proc.returncode}) before {what}:\n"
                                 f"{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.01)


# ---- a training launch, killed ----------------------------------------------------------------

@dataclass
class Killed:
    """What a kill left: the session's processes, W&B services, and the launcher's end."""

    left: list[tuple[int, int, str]]
    services_left: list[int]
    children_before: int  # processes the ranks had started when they were killed
    services_before: int
    returncode: int
    log: str

    def describe(self) -> str:
        return "\n".join(f"{pid} (parent {parent}): {cmd[:160]}" for pid, parent, cmd in
                         self.left) + (f"\nW&B services {self.services_left}"
                                       if self.services_left else "")


def _partial_save(out: Path) -> bool:
    root = out / "checkpoints"
    return root.is_dir() and any(p.name.endswith(".partial") for p in root.iterdir())


def _wandb_services(ranks: list[int]) -> list[int]:
    """W&B's service processes watching a rank (they run in sessions of their own)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            parts = command_line(int(entry.name)).split()
            if parts and parts[0].endswith("wandb-core") and "--pid" in parts and \
                    int(parts[parts.index("--pid") + 1]) in ranks:
                found.append(int(entry.name))
    return found


def kill_a_training_run(tmp: Path, *, target: str, workers: int, when: str,
                        wandb: bool = False) -> Killed:
    """Start ``megatron-packing train`` (2 ranks, ``workers`` loader workers each) in a session
    of its own; ``when`` it is "after a save" (step 3, the step-2 checkpoint published) or
    "during a save" (a second one under way), SIGKILL the ``target`` ("launcher", "one rank",
    "process group"); then list what is left of the session after a few seconds."""
    every = 1 if when == "during a save" else 2
    doc = tiny_config(tmp, steps=400, train__checkpoint_every=every,
                      train__num_workers=workers, logging__wandb=wandb)
    out, log = tmp / "out", tmp / "run.log"
    args = train_command(write_config(tmp / "c.yaml", doc), out,
                         *([] if wandb else ["--no-wandb"]))
    env = {**cli_env(), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    launcher = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                                cwd=tmp, start_new_session=True)
    session = {launcher.pid}
    try:
        if when == "during a save":
            wait_until(lambda: (out / "checkpoints" / "latest").exists() and _partial_save(out),
                       launcher, log, what="a second save under way")
        else:
            wait_until(lambda: (out / "checkpoints" / "step_000002").is_dir() and
                       "[train] step    3" in log.read_text(), launcher, log,
                       what="step 3 after a save")
        ranks = [pid for pid, parent, cmd in session_processes(session)
                 if parent == launcher.pid and "spawn_main" in cmd]
        assert len(ranks) == 2, session_processes(session)
        children = [p for p, parent, _ in session_processes(session) if parent in ranks]
        services = _wandb_services(ranks) if wandb else []
        if target == "launcher":
            os.kill(launcher.pid, signal.SIGKILL)
        elif target == "one rank":
            os.kill(ranks[1], signal.SIGKILL)
        elif target == "process group":
            os.killpg(launcher.pid, signal.SIGKILL)
        else:
            raise ValueError(f"no such target {target!r}")
        launcher.wait(timeout=30)
        return Killed(left_after(session), wait_gone(services, timeout=8), len(children),
                      len(services), launcher.returncode, log.read_text())
    finally:
        launcher.kill()
        launcher.wait()
        kill_sessions(session)


# ---- file systems that refuse writes ---------------------------------------------------------

def can_mount() -> bool:
    """Whether this process may mount a tmpfs (root with CAP_SYS_ADMIN)."""
    if os.geteuid() != 0:
        return False
    status = Path("/proc/self/status").read_text()
    effective = int(next(line.split()[1] for line in status.splitlines()
                         if line.startswith("CapEff:")), 16)
    return bool(effective & (1 << 21))


@contextlib.contextmanager
def tmpfs(path: Path, *, size: str = "4m", read_only: bool = False) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` (read-only: no write reaches it, even root's)."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True,
                   capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def read_only_dir(path: Path) -> Iterator[Path]:
    """A directory no write reaches: a read-only tmpfs as root (mode 0555 does not stop root),
    else mode 0555."""
    if can_mount():
        with tmpfs(path, size="64k", read_only=True):
            yield path
        return
    if os.geteuid() == 0:
        import pytest

        pytest.skip("root without the right to mount: no directory refuses its writes")
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o555)
    try:
        yield path
    finally:
        path.chmod(0o755)


def file_size_limit(limit: int) -> Callable[[], None]:
    """A ``preexec_fn`` that sets RLIMIT_FSIZE (``ulimit -f``) in the launched process; Python
    ignores SIGXFSZ, so a write beyond the limit fails with EFBIG."""
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def fill(directory: Path) -> None:
    """Fill the file system under ``directory`` until it has no room left."""
    with open(directory / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)
