"""Concurrent loads of one cache entry: one process builds, the others wait on its file lock
(progress lines, no timeout), then read the entry; a builder that dies lets a waiter build.

An flock belongs to an open file, so a thread of this process that opens the lock file itself
contends with the main thread exactly as another rank would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from megatron_packing.data import build_lock, chunk_encoding, length_index, load_sft_dataset
from megatron_packing.data.length_index import held_locks

PROJECT = Path(__file__).resolve().parents[2]
TOKENIZER = PROJECT / "examples" / "tokenizer"
CHATS = 200


@pytest.fixture
def chats(tmp_path: Path) -> Path:
    lines = (PROJECT / "examples" / "data" / "demo_chat.jsonl").read_text().splitlines()
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(lines[:CHATS]) + "\n")
    return path


@pytest.fixture
def builds(monkeypatch):
    calls: list[Path] = []
    real = length_index._build

    def counting(final, *args, **kwargs):
        calls.append((threading.current_thread().name, final))
        return real(final, *args, **kwargs)

    monkeypatch.setattr(length_index, "_build", counting)
    return calls


class Said:
    """The waiting lines, as printed; `then` runs an action once after the line that makes
    its test true."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.hooks: list = []

    def __call__(self, message: str) -> None:
        print(message, file=sys.stderr)
        self.lines.append(message)
        for hook in list(self.hooks):
            if hook[0](self.lines):
                self.hooks.remove(hook)
                hook[1]()

    def then(self, test, action) -> None:
        self.hooks.append((test, action))


@pytest.fixture
def said(monkeypatch) -> Said:
    said = Said()
    monkeypatch.setattr(build_lock, "say", said)
    monkeypatch.setattr(length_index, "say", said)
    return said


def load(chats: Path, cache: Path):
    return load_sft_dataset(chats, str(TOKENIZER), cache_dir=cache, show_progress=False)


def entry_name(chats: Path, tmp_path: Path) -> str:
    """The cache entry's name (its key does not depend on the cache directory)."""
    return Path(load(chats, tmp_path / "probe").index_paths[0]).name


def still_waiting(count: int):
    return lambda lines: sum(line.startswith("still waiting") for line in lines) >= count


def test_a_waiter_reports_progress_then_reads_what_the_holder_built(chats, tmp_path, builds,
                                                                    said, monkeypatch):
    monkeypatch.setattr(build_lock, "PROGRESS_INTERVAL_S", 0.3)
    cache, release, started = tmp_path / "cache", threading.Event(), threading.Event()
    encode = chunk_encoding.encode_chunk

    def holder_encode(*args, **kwargs):  # the holder builds until the waiter has waited a while
        if threading.current_thread().name == "holder":
            started.set()
            release.wait(60)
        return encode(*args, **kwargs)

    monkeypatch.setattr(chunk_encoding, "encode_chunk", holder_encode)
    said.then(still_waiting(2), release.set)
    holder = threading.Thread(target=load, args=(chats, cache), name="holder")
    holder.start()
    assert started.wait(60), "the holder never started building"
    (lock,) = held_locks(cache, chats.name)
    ds = load(chats, cache)
    holder.join(60)
    lines = said.lines
    assert [name for name, _ in builds] == ["holder"], "the waiter built the entry itself"
    assert len(ds) == CHATS
    waiting = [line for line in lines if "waiting for the length index of" in line]
    assert waiting[0].startswith(f"waiting for the length index of {chats}: another process "
                                 f"builds it and holds the lock {lock}, held by pid {os.getpid()}")
    still = [line for line in waiting if line.startswith("still waiting")]
    assert len(still) >= 2, lines
    assert all(f"lock {lock}" in line and "s so far" in line for line in still)
    assert any(line.startswith(f"the length index of {chats} is built") for line in lines)
    assert not any("building it here" in line for line in lines)


# Another process in the middle of a build: it holds the entry's lock and has a partial
# directory, until it is killed.
BUILDER = textwrap.dedent("""
    import fcntl, sys, time
    from pathlib import Path
    lock, partial = Path(sys.argv[1]), Path(sys.argv[2])
    lock.parent.mkdir(parents=True, exist_ok=True)
    f = lock.open("a+")
    fcntl.flock(f, fcntl.LOCK_EX)
    partial.mkdir()
    (partial / "input_ids.bin").write_bytes(b"partial")
    print("held", flush=True)
    time.sleep(600)
""")


def test_a_builder_that_dies_lets_the_waiter_build(chats, tmp_path, builds, said, monkeypatch):
    monkeypatch.setattr(build_lock, "PROGRESS_INTERVAL_S", 0.3)
    name = entry_name(chats, tmp_path)
    builds.clear()
    cache = tmp_path / "cache"
    lock, partial = cache / f".{name}.lock", cache / f".{name}.dead1234"
    builder = subprocess.Popen([sys.executable, "-c", BUILDER, str(lock), str(partial)],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert builder.stdout is not None and builder.stdout.readline().strip() == "held"
        said.then(still_waiting(1), lambda: os.kill(builder.pid, signal.SIGKILL))
        ds = load(chats, cache)
    finally:
        if builder.poll() is None:
            builder.kill()
        builder.wait()
    lines = said.lines
    assert builder.returncode == -signal.SIGKILL
    assert any(line.startswith("waiting for the length index of") for line in lines)
    assert (f"the process that held {lock} ended without finishing the length index of {chats} "
            "(it failed, died or was stopped); building it here") in lines
    assert len(builds) == 1 and len(ds) == CHATS
    assert not partial.exists(), "the dead builder's partial directory was left behind"
    assert len(load(chats, cache)) == CHATS and len(builds) == 1


def test_a_finished_entry_loads_without_waiting_on_a_held_lock(chats, tmp_path, builds, said):
    cache = tmp_path / "cache"
    load(chats, cache)
    (lock,) = cache.glob(f".{chats.name}-*.lock")
    release, held = threading.Event(), threading.Event()

    def hold() -> None:  # as a concurrent load that takes the lock would
        with build_lock.entry_lock(lock, what="test"):
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(60)
        assert len(load(chats, cache)) == CHATS
    finally:
        release.set()
        holder.join()
    assert len(builds) == 1
    assert not any("waiting" in line for line in said.lines)
