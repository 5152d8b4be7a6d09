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
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import chunk_encoding as encoding
from . import shared_build
from .build_lock import entry_lock, say
from .errors import BadRecordError
from .records import RawItem
from .store import StoreWriter, TokenStore, drop_partial_writes
from .tokenize import ChatEncoder

log = logging.getLogger(__name__)

INDEX_VERSION = 3  # 3: per-message weight and tool-call arguments checked
PARALLEL_MIN_RECORDS = encoding.PARALLEL_MIN_RECORDS


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
    items: Callable[[], Iterable[RawItem]],
    total: int | Callable[[], int] | None,
    raw_is_text: bool,
    encoder: ChatEncoder,
    tokenizer_fp: str,
    cache_dir: Path,
    on_bad_record: str,
    num_proc: int | None,
    show_progress: bool,
    sharers: int = 1,
) -> TokenStore:
    """Return the cached store for this source, building it first when missing.

    ``items`` opens the source's records (a shared build may read them more than once);
    ``total`` (records, for the progress bar, the process count and a shared build's parts)
    may be a function, called only when the entry is built: counting a large file's lines
    would slow every warm load. ``sharers`` > 1 (the processes that load this source at once,
    a job's ranks) builds a missing entry with all of them (`shared_build`); 1 builds it in
    the process that takes the entry's lock while the others wait on that lock.
    """
    key = cache_key(data_hash, tokenizer_fp, encoder)
    final = cache_dir / f"{_safe(name)}-{key}"
    lock = cache_dir / f".{_safe(name)}-{key}.lock"
    meta = _entry_meta(key, source, data_hash, encoder, tokenizer_fp)
    if (final / "meta.json").is_file():
        # A finished entry is moved into place whole and never rewritten: no lock to wait on.
        store = TokenStore(final)
        log.debug("reusing length index %s", final)
    elif sharers > 1:
        store = shared_build.build_shared(shared_build.SharedBuild(
            final=final, lock=lock, source=source, open_items=items,
            total=total() if callable(total) else total, raw_is_text=raw_is_text,
            encoder=encoder, on_bad_record=on_bad_record, meta=meta, sharers=sharers,
            num_proc=num_proc, show_progress=show_progress))
    else:
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
                drop_partial_writes(final)
                if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # ranks of a job may wait
                    say(f"building the length index of {source} in {final}; other processes "
                        f"loading it wait on {lock}")
                if callable(total):
                    total = total()
                store = _build(final, meta, source, items(), total, raw_is_text, encoder,
                               on_bad_record, num_proc, show_progress)
    if on_bad_record == "error":
        raise_first_bad(store.meta)
    return store


def _entry_meta(key: str, source: str, data_hash: str, encoder: ChatEncoder,
                tokenizer_fp: str) -> dict[str, Any]:
    """What a cache entry's meta records about its source and tokenization."""
    return {
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
    }


def _build(
    final: Path, meta: dict[str, Any], source: str, items: Iterable[RawItem],
    total: int | None, raw_is_text: bool, encoder: ChatEncoder, on_bad_record: str,
    num_proc: int | None, show_progress: bool,
) -> TokenStore:
    from tqdm.auto import tqdm

    if num_proc is None:
        num_proc = encoding.default_num_proc(total)
    tally = encoding.SkipTally(source, on_bad_record)
    writer = StoreWriter(final)
    try:
        with tqdm(total=total, unit="rec", desc=f"tokenizing {Path(source).name}",
                  disable=not show_progress) as bar:
            for n, res in encoding.ordered_results(items, raw_is_text, encoder, num_proc):
                tally.add(res)
                writer.append(res.ids, res.mask, res.lengths, res.lines)
                bar.update(n)
    except BaseException:
        writer.abort()
        raise
    return writer.commit({**meta, **tally.meta()})


def _safe(name: str) -> str:
    keep = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
    return keep[:60] or "data"
