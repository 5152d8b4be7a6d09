"""Build the tokenized length index once, in parallel, and cache it on disk.

The cache entry for one source is a :mod:`~megatron_packing.data.store` directory named by a
hash of the source's content, the tokenizer (serialization, special tokens, chat template) and
the tokenization options. A changed input, tokenizer, template or option gives a new key, so a
stale entry is never read; an unchanged one loads in milliseconds (memory-mapped).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import multiprocessing as mp
import os
import shutil
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .build_lock import entry_lock, say
from .errors import BadRecordError, RecordProblem
from .records import Messages, RawItem, parse_json_line, record_to_messages
from .store import StoreWriter, TokenStore
from .tokenize import ChatEncoder

log = logging.getLogger(__name__)

INDEX_VERSION = 3  # 3: per-message weight and tool-call arguments checked
MAX_SKIP_EXAMPLES = 20
BATCH = 256  # conversations per tokenizer call
CHUNK = 2048  # records per worker task
PARALLEL_MIN_RECORDS = 20_000


@dataclass
class LengthIndex:
    """Per-example token lengths and loss-target counts, read without loading examples."""

    lengths: np.ndarray
    loss_token_counts: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)


def load_length_index(path: str | os.PathLike[str]) -> LengthIndex:
    """Read lengths and loss-token counts of a cache entry or pre-tokenized directory."""
    store = TokenStore(path)
    return LengthIndex(store.lengths, store.loss_token_counts, store.meta)


def default_cache_dir() -> Path:
    """``$MEGATRON_PACKING_CACHE``, else ``$XDG_CACHE_HOME/megatron_packing/sft``."""
    env = os.environ.get("MEGATRON_PACKING_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatron_packing" / "sft"


# A remembered file hash is trusted only for a file last changed this long before it was hashed:
# a write within one file-system timestamp tick of the hashed state could keep its times.
HASH_MEMO_SETTLED_S = 2.0


def hash_file(path: Path, memo_dir: Path | None = None) -> str:
    """Content hash of a file (streamed).

    With ``memo_dir``, the hash is remembered there, keyed by the file's absolute path, and
    reused while the file's size, inode, mtime and ctime are unchanged (any write changes the
    ctime, which no tool can set back), so a warm load does not read the whole file again.
    """
    memo = _hash_memo_path(path, memo_dir) if memo_dir is not None else None
    before = path.stat()
    stamp = [before.st_size, before.st_ino, before.st_mtime_ns, before.st_ctime_ns]
    if memo is not None:
        try:
            saved = json.loads(memo.read_text())
            if saved.get("stamp") == stamp and isinstance(saved.get("hash"), str):
                return saved["hash"]
        except (OSError, ValueError):
            pass
    started = time.time()
    digest = _hash_file_bytes(path)
    after = path.stat()
    settled = max(after.st_mtime_ns, after.st_ctime_ns) / 1e9 < started - HASH_MEMO_SETTLED_S
    if memo is not None and settled and [after.st_size, after.st_ino, after.st_mtime_ns,
                                         after.st_ctime_ns] == stamp:
        with contextlib.suppress(OSError):
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_name(f".{memo.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"path": str(path.resolve()), "stamp": stamp, "hash": digest}))
            os.replace(tmp, memo)
    return digest


def _hash_file_bytes(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _hash_memo_path(path: Path, memo_dir: Path) -> Path:
    key = hashlib.blake2b(str(path.resolve()).encode(), digest_size=12).hexdigest()
    return memo_dir / ".file_hashes" / f"{key}.json"


def hash_rows(rows: Iterable[Any]) -> str:
    """Content hash of dataset rows (their JSON, keys sorted)."""
    h = hashlib.blake2b(digest_size=16)
    for row in rows:
        h.update(json.dumps(row, sort_keys=True, default=str).encode())
        h.update(b"\n")
    return h.hexdigest()


def cache_key(data_hash: str, tokenizer_fp: str, encoder: ChatEncoder) -> str:
    """Key of one cache entry: data, tokenizer + template, and tokenization options."""
    payload = {
        "index_version": INDEX_VERSION,
        "data": data_hash,
        "tokenizer": tokenizer_fp,
        "loss_on": encoder.loss_on,
        "max_length": encoder.max_length,
        "truncate": encoder.truncate,
        "method": encoder.method,
        "special_tokens_in_content": encoder.special_tokens_in_content,
    }
    return hashlib.blake2b(json.dumps(payload, sort_keys=True).encode(), digest_size=16).hexdigest()


# -- chunk encoding (runs in workers) ------------------------------------------------------
_WORKER_ENCODER: ChatEncoder | None = None


@dataclass
class ChunkResult:
    ids: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray
    lines: np.ndarray
    bad: list[tuple[int, str, str]]
    special_text_records: int = 0  # records whose content holds a control token's text


def encode_chunk(encoder: ChatEncoder, items: list[RawItem], raw_is_text: bool) -> ChunkResult:
    """Validate and tokenize a chunk of raw records; bad ones are reported, not raised."""
    bad: list[tuple[int, str, str]] = []
    good: list[tuple[int, Messages]] = []
    for line, raw in items:
        try:
            record = parse_json_line(raw) if raw_is_text else raw
            good.append((line, record_to_messages(record)))
        except RecordProblem as exc:
            bad.append((line, exc.reason, exc.detail))
    special = sum(encoder.has_special_text(m) for _, m in good)
    ids_parts, mask_parts, lengths, lines = [], [], [], []
    for start in range(0, len(good), BATCH):
        batch = good[start : start + BATCH]
        for (line, _), res in zip(batch, encoder.encode_batch([m for _, m in batch]), strict=True):
            if isinstance(res, RecordProblem):
                bad.append((line, res.reason, res.detail))
                continue
            ids_parts.append(res[0])
            mask_parts.append(res[1])
            lengths.append(len(res[0]))
            lines.append(line)
    bad.sort()
    return ChunkResult(
        np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.int32),
        np.concatenate(mask_parts) if mask_parts else np.zeros(0, np.uint8),
        np.asarray(lengths, dtype=np.int64),
        np.asarray(lines, dtype=np.int64),
        bad,
        special,
    )


def _worker_encode(args: tuple[list[RawItem], bool]) -> ChunkResult:
    assert _WORKER_ENCODER is not None
    return encode_chunk(_WORKER_ENCODER, *args)


def _chunks(items: Iterable[RawItem], size: int) -> Iterator[list[RawItem]]:
    chunk: list[RawItem] = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _ordered_results(
    items: Iterable[RawItem], raw_is_text: bool, encoder: ChatEncoder, num_proc: int
) -> Iterator[tuple[int, ChunkResult]]:
    """Encode chunks in order; with ``num_proc > 1`` a bounded window runs in a fork pool."""
    if num_proc <= 1:
        for chunk in _chunks(items, CHUNK):
            yield len(chunk), encode_chunk(encoder, chunk, raw_is_text)
        return
    global _WORKER_ENCODER
    _WORKER_ENCODER = encoder  # inherited by forked workers
    ctx = mp.get_context("fork")
    pool = ctx.Pool(num_proc)
    try:
        pending: deque[tuple[int, Any]] = deque()
        for chunk in _chunks(items, CHUNK):
            pending.append((len(chunk), pool.apply_async(_worker_encode, ((chunk, raw_is_text),))))
            if len(pending) >= 3 * num_proc:
                n, res = pending.popleft()
                yield n, res.get()
        while pending:
            n, res = pending.popleft()
            yield n, res.get()
    finally:
        pool.terminate()
        pool.join()
        _WORKER_ENCODER = None


def held_locks(cache_dir: Path, name: str) -> list[Path]:
    """Lock files of ``cache_dir``'s entries for a source called ``name`` (a file's name) that
    a build holds now (a non-blocking try of the lock `build_or_load` takes and waits on)."""
    held = []
    for path in sorted(Path(cache_dir).glob(f".{_safe(name)}-*.lock")):
        try:
            with path.open("a") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    held.append(path)
                else:
                    fcntl.flock(f, fcntl.LOCK_UN)
        except OSError:
            continue  # unreadable or gone: not a lock this process could wait on
    return held


def raise_first_bad(store_meta: dict[str, Any]) -> None:
    """In error mode, a cached entry that skipped records raises for its first bad record."""
    examples = store_meta.get("skipped_examples") or []
    if examples:
        first = examples[0]
        raise BadRecordError(first["source"], first["line"], first["reason"], first["detail"])


def build_or_load(
    *,
    name: str,
    source: str,
    data_hash: str,
    items: Iterable[RawItem],
    total: int | Callable[[], int] | None,
    raw_is_text: bool,
    encoder: ChatEncoder,
    tokenizer_fp: str,
    cache_dir: Path,
    on_bad_record: str,
    num_proc: int | None,
    show_progress: bool,
) -> TokenStore:
    """Return the cached store for this source, building it first when missing.

    ``total`` (records, for the progress bar and the process count) may be a function, called
    only when the entry is built: counting a large file's lines would slow every warm load.
    """
    key = cache_key(data_hash, tokenizer_fp, encoder)
    final = cache_dir / f"{_safe(name)}-{key}"
    if (final / "meta.json").is_file():
        # A finished entry is moved into place whole and never rewritten: no lock to wait on.
        store = TokenStore(final)
        log.debug("reusing length index %s", final)
    else:
        lock = cache_dir / f".{_safe(name)}-{key}.lock"
        with entry_lock(lock, what=f"the length index of {source}") as wait:
            if (final / "meta.json").is_file():
                store = TokenStore(final)
                if wait.waited:
                    say(f"the length index of {source} is built ({wait.seconds:.0f} s waited); "
                        f"loading {final}")
            else:
                if wait.waited:
                    say(f"the process that held {lock} ended without finishing the length index "
                        f"of {source} (it failed, died or was stopped); building it here")
                _drop_partial_builds(final)
                if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # ranks of a job may wait
                    say(f"building the length index of {source} in {final}; other processes "
                        f"loading it wait on {lock}")
                if callable(total):
                    total = total()
                store = _build(
                    final, key, source, data_hash, items, total, raw_is_text, encoder,
                    tokenizer_fp, on_bad_record, num_proc, show_progress,
                )
    if on_bad_record == "error":
        raise_first_bad(store.meta)
    return store


def _drop_partial_builds(final: Path) -> None:
    """Remove what a dead builder of ``final`` left (its temporary directories); only a
    process holding the entry's lock writes them, and this one holds it now."""
    for partial in final.parent.glob(f".{final.name}.*"):
        if partial.is_dir():
            shutil.rmtree(partial, ignore_errors=True)


def _build(
    final: Path, key: str, source: str, data_hash: str, items: Iterable[RawItem],
    total: int | None, raw_is_text: bool, encoder: ChatEncoder, tokenizer_fp: str,
    on_bad_record: str, num_proc: int | None, show_progress: bool,
) -> TokenStore:
    from tqdm.auto import tqdm

    if num_proc is None:
        num_proc = min(os.cpu_count() or 1, 8) if (total or 0) >= PARALLEL_MIN_RECORDS else 1
    skipped: Counter[str] = Counter()
    special_records = 0
    examples: list[dict[str, Any]] = []
    writer = StoreWriter(final)
    try:
        with tqdm(total=total, unit="rec", desc=f"tokenizing {Path(source).name}",
                  disable=not show_progress) as bar:
            for n, res in _ordered_results(items, raw_is_text, encoder, num_proc):
                if res.bad and on_bad_record == "error":
                    line, reason, detail = res.bad[0]
                    raise BadRecordError(source, line, reason, detail)
                for line, reason, detail in res.bad:
                    skipped[reason] += 1
                    if len(examples) < MAX_SKIP_EXAMPLES:
                        examples.append({"source": source, "line": line, "reason": reason, "detail": detail})
                special_records += res.special_text_records
                writer.append(res.ids, res.mask, res.lengths, res.lines)
                bar.update(n)
    except BaseException:
        writer.abort()
        raise
    return writer.commit({
        "kind": "cache",
        "key": key,
        "source": source,
        "data_hash": data_hash,
        "tokenizer_fingerprint": tokenizer_fp,
        "loss_on": encoder.loss_on,
        "max_length": encoder.max_length,
        "truncate": encoder.truncate,
        "method": encoder.method,
        "special_tokens_in_content": encoder.special_tokens_in_content,
        "special_token_records": special_records,
        "skipped": dict(skipped),
        "skipped_examples": examples,
    })


def _safe(name: str) -> str:
    keep = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
    return keep[:60] or "data"
