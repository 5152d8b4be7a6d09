"""A cache entry built by every process that loads it: each tokenizes parts, one merges.

The proof is the entry itself: built by several processes (or by one process cut into parts),
its files are byte for byte those of a build by one process. The processes here are real
processes sharing a cache directory, as a job's ranks do; a sharer killed with SIGKILL in the
middle of a part leaves that part to the others.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_packing.data import load_sft_dataset, shared_build
from megatron_packing.data.shared_build import part_size
from megatron_packing.data.tokenize import load_tokenizer

PROJECT = Path(__file__).resolve().parents[2]
TOKENIZER = PROJECT / "examples" / "tokenizer"
CHATS = (PROJECT / "examples" / "data" / "demo_chat.jsonl").read_text().splitlines()
BAD_LINES = ('{"messages": []}', "not json at all")


def write_chats(path: Path, count: int, bad: dict[int, str] | None = None) -> Path:
    """``count`` demo chats, one per line, with the records at ``bad``'s positions replaced."""
    lines = [CHATS[i % len(CHATS)] for i in range(count)]
    for position, line in (bad or {}).items():
        lines[position] = line
    path.write_text("\n".join(lines) + "\n")
    return path


def entry_files(cache: Path) -> dict[str, bytes]:
    """Every file of the cache's one entry, by name (hidden lock and hash files left out)."""
    (entry,) = [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return {f.name: f.read_bytes() for f in sorted(entry.iterdir())}


@functools.cache
def tokenizer():
    return load_tokenizer(str(TOKENIZER))


def single_build(data: Path, cache: Path, **kwargs) -> dict[str, bytes]:
    load_sft_dataset(data, tokenizer(), cache_dir=cache, show_progress=False,
                     build_sharers=1, **kwargs)
    return entry_files(cache)


# -- parts: sizes, and the merged entry of one process against a single build ---------------

@given(total=st.integers(0, 10**8), sharers=st.integers(1, 4096))
def test_parts_cover_the_records_within_their_size_bounds(total, sharers):
    size = part_size(total, sharers)
    assert shared_build.MIN_PART_RECORDS <= size <= shared_build.MAX_PART_RECORDS
    count = max(1, -(-total // size))
    assert count * size >= total and (count - 1) * size < max(total, 1)
    if shared_build.MIN_PART_RECORDS * shared_build.PARTS_PER_SHARER * sharers <= total <= (
            shared_build.MAX_PART_RECORDS * shared_build.PARTS_PER_SHARER * sharers):
        # about PARTS_PER_SHARER parts for every sharer (fewer only by the size's rounding up)
        assert count >= 0.99 * shared_build.PARTS_PER_SHARER * sharers


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(count=st.integers(1, 40), sharers=st.integers(2, 6),
       bad=st.dictionaries(st.integers(0, 39), st.sampled_from(BAD_LINES), max_size=4))
def test_an_entry_merged_from_parts_is_the_single_build_byte_for_byte(
        tmp_path_factory, monkeypatch, count, sharers, bad):
    monkeypatch.setattr(shared_build, "MIN_PART_RECORDS", 1)
    tmp = tmp_path_factory.mktemp("merge")
    bad = {k: v for k, v in bad.items() if k < count}
    if len(bad) == count:
        bad.pop(min(bad))
    data = write_chats(tmp / "chats.jsonl", count, bad)
    alone = single_build(data, tmp / "alone", on_bad_record="skip")
    load_sft_dataset(data, tokenizer(), cache_dir=tmp / "parts", show_progress=False,
                     build_sharers=sharers, on_bad_record="skip")
    assert entry_files(tmp / "parts") == alone
    assert not list((tmp / "parts").glob(".*-parts-*")), "the parts were left behind"


def test_build_sharers_is_checked(tmp_path):
    data = write_chats(tmp_path / "chats.jsonl", 3)
    with pytest.raises(ValueError, match=r"build_sharers=0 is not valid; give a process count"):
        load_sft_dataset(data, str(TOKENIZER), cache_dir=tmp_path / "c", build_sharers=0)


# -- real processes sharing one cache directory --------------------------------------------

DYING_S = 4.0  # a dying sharer holds its part's lock this long: the others pass it, then wait

SHARER = textwrap.dedent("""
    import json, os, signal, sys, time
    from pathlib import Path
    from megatron_packing.data import BadRecordError, chunk_encoding, load_sft_dataset

    data, cache, tokenizer, sharers, delay, die_after, ready, go = sys.argv[1:]
    encode = chunk_encoding.encode_chunk
    started = []

    def slow(encoder, items, raw_is_text):  # so every sharer gets parts to build
        started.append(items[0][0])
        if int(die_after) and len(started) > int(die_after):  # in the middle of a part,
            print("dying in the part that starts at line", items[0][0], flush=True)
            time.sleep(DYING_S)  # once the others had time to pass it (its lock held)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(float(delay))
        return encode(encoder, items, raw_is_text)

    chunk_encoding.encode_chunk = slow
    Path(ready).touch()
    while not Path(go).exists():
        time.sleep(0.01)
    try:
        ds = load_sft_dataset(data, tokenizer, cache_dir=cache, show_progress=False,
                              build_sharers=int(sharers), num_proc=1)
    except BadRecordError as exc:
        print("BAD:", exc, flush=True)
        sys.exit(3)
    print(json.dumps({"examples": len(ds)}), flush=True)
""").replace("DYING_S", repr(DYING_S))


def run_sharers(data: Path, cache: Path, tmp: Path, *, sharers: int = 2, delay: float = 0.15,
                die_after: dict[int, int] | None = None) -> list[subprocess.CompletedProcess]:
    """Start ``sharers`` processes, let them load ``data`` at the same moment, wait for all;
    process ``i`` kills itself in the part after its first ``die_after[i]`` parts."""
    go = tmp / "go"
    procs, ready = [], []
    for i in range(sharers):
        ready.append(tmp / f"ready{i}")
        args = [str(data), str(cache), str(TOKENIZER), str(sharers), str(delay),
                str((die_after or {}).get(i, 0)), str(ready[-1]), str(go)]
        procs.append(subprocess.Popen([sys.executable, "-c", SHARER, *args], cwd=PROJECT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env={**os.environ, "RANK": str(i)}))
    deadline = time.monotonic() + 120
    while not all(r.exists() for r in ready) and time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.05)
    go.touch()
    done = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out))
    return done


BUILT = re.compile(r"is built \((\d+) of (\d+) parts tokenized here, (merged here|another "
                   r"process merged it)")


def shares(run: subprocess.CompletedProcess) -> tuple[int, int, bool]:
    """(parts this process tokenized, parts in all, whether it merged) from its summary."""
    (found,) = BUILT.findall(run.stdout)
    return int(found[0]), int(found[1]), found[2] == "merged here"


RECORDS = 2400  # 2,400 / (4 parts per sharer x 2) = 300 records per part: 8 parts


@pytest.mark.slow
def test_two_processes_share_the_parts_and_write_the_single_build(tmp_path):
    data = write_chats(tmp_path / "chats.jsonl", RECORDS)
    runs = run_sharers(data, tmp_path / "shared", tmp_path)
    for run in runs:
        assert run.returncode == 0, run.stdout[-3000:]
        assert json.loads(run.stdout.strip().splitlines()[-1]) == {"examples": RECORDS}
    (here0, total, merged0), (here1, total1, merged1) = map(shares, runs)
    assert total == total1 == 8
    assert here0 + here1 == 8, "a part was tokenized twice, or by nobody"
    assert here0 > 0 and here1 > 0, "one process built every part: the build was not shared"
    assert merged0 != merged1, "the entry was merged twice, or by nobody"
    assert entry_files(tmp_path / "shared") == single_build(data, tmp_path / "alone")
    assert not list((tmp_path / "shared").glob(".*-parts-*"))


@pytest.mark.slow
def test_a_sharer_killed_in_a_part_leaves_it_to_the_other(tmp_path):
    data = write_chats(tmp_path / "chats.jsonl", RECORDS)
    # process 0 kills itself (SIGKILL) in its second part, holding that part's lock while
    # process 1 passes it and then waits on it
    runs = run_sharers(data, tmp_path / "shared", tmp_path, die_after={0: 1})
    assert runs[0].returncode == -9, runs[0].stdout[-3000:]
    (line,) = re.findall(r"dying in the part that starts at line (\d+)", runs[0].stdout)
    part = (int(line) - 1) // 300 + 1
    assert f"waiting for part {part} of 8 of the length index of {data}" in runs[1].stdout
    assert runs[1].returncode == 0, runs[1].stdout[-3000:]
    here, total, merged = shares(runs[1])
    assert merged and total == 8 and here == 7, "the killed sharer's part was not rebuilt"
    assert entry_files(tmp_path / "shared") == single_build(data, tmp_path / "alone")
    leftovers = [p for p in (tmp_path / "shared").iterdir() if p.name.startswith(".")
                 and p.is_dir() and p.name != ".file_hashes"]
    assert not leftovers, f"the killed sharer's partial files were left: {leftovers}"


@pytest.mark.slow
def test_a_bad_record_in_error_mode_stops_every_sharer_with_the_same_message(tmp_path):
    data = write_chats(tmp_path / "chats.jsonl", RECORDS, bad={1500: '{"messages": []}'})
    runs = run_sharers(data, tmp_path / "shared", tmp_path)
    for run in runs:
        assert run.returncode == 3, run.stdout[-3000:]
        (message,) = [line for line in run.stdout.splitlines() if line.startswith("BAD:")]
        assert f"{data}:1501" in message and "empty_conversation" in message, message
    assert not [p for p in (tmp_path / "shared").iterdir() if not p.name.startswith(".")]
