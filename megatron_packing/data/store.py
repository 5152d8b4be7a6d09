"""On-disk token store: flat token ids + loss masks with offsets, memory-mapped.

One store is a directory::

    meta.json               format, version, counts, options, skipped-record summary
    input_ids.bin           all examples' token ids, concatenated (dtype in meta, int32)
    loss_mask.bin           the matching loss masks, uint8
    offsets.npy             int64 [n + 1]: example i is [offsets[i], offsets[i + 1])
    lengths.npy             int32 [n]: tokens per example
    loss_token_counts.npy   int32 [n]: loss_mask[1:].sum() per example
    record_lines.npy        int64 [n]: 1-based line/row of the source record

The same format serves as the length-index cache and as the pre-tokenized file format. Stores
are written into a temporary directory and renamed into place, so a reader never sees half of
one.

``meta.json`` also records, at build time, the total loss-token count and an xxh3 checksum of
every array file. Opening a store checks what is cheap (array sizes against each other and the
files, offsets against lengths, the recorded sums); the first open in a process also checks the
checksums. A store that fails a check is refused with :class:`CorruptStoreError`, naming the
file, instead of feeding wrong tokens, lengths or loss counts to training.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

FORMAT = "megatron_packing.sft_tokens"
VERSION = 2
META = "meta.json"
ID_DTYPE = np.int32
ARRAY_FILES = ("input_ids.bin", "loss_mask.bin", "offsets.npy", "lengths.npy",
               "loss_token_counts.npy", "record_lines.npy")


class CorruptStoreError(ValueError):
    """A token store whose files disagree with each other or with what was recorded at build."""

    def __init__(self, path: Path, file: str, problem: str, kind: str | None) -> None:
        self.path = path
        self.file = file
        self.problem = problem
        fix = (
            f"re-save the pre-tokenized data to {path}" if kind == "pretokenized"
            else f"delete the cache entry {path} (or the whole cache directory) so it is rebuilt"
        )
        super().__init__(f"{path / file}: {problem}; the token store is corrupted or was modified: {fix}")


def file_checksum(path: Path) -> str:
    """xxh3-128 of a file's bytes, streamed (several GB/s, so cheap next to tokenizing)."""
    h = xxhash.xxh3_128()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def is_store(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a token-store directory (cache entry or pre-tokenized data)."""
    meta = Path(path) / META
    if not meta.is_file():
        return False
    try:
        return json.loads(meta.read_text()).get("format") == FORMAT
    except (OSError, ValueError):
        return False


class TokenStore:
    """Read-only view of a store directory; arrays are memory-mapped, nothing is read eagerly."""

    def __init__(self, path: str | os.PathLike[str], *, verify_checksums: bool = True) -> None:
        self.path = Path(path)
        meta = json.loads((self.path / META).read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"{self.path} is not a token store (meta.json format != {FORMAT!r})")
        if meta.get("version") != VERSION:
            raise ValueError(
                f"{self.path} has store version {meta.get('version')}, this code reads {VERSION}; "
                "rebuild it (delete the cache entry or re-save the pre-tokenized data)"
            )
        self.meta: dict[str, Any] = meta
        self._check_files(verify_checksums)
        n, total = int(meta["num_examples"]), int(meta["num_tokens"])
        self.offsets = np.load(self.path / "offsets.npy", mmap_mode="r")
        self.lengths = np.load(self.path / "lengths.npy", mmap_mode="r")
        self.loss_token_counts = np.load(self.path / "loss_token_counts.npy", mmap_mode="r")
        self.record_lines = np.load(self.path / "record_lines.npy", mmap_mode="r")
        self._ids = _memmap(self.path / "input_ids.bin", np.dtype(meta["id_dtype"]), total)
        self._mask = _memmap(self.path / "loss_mask.bin", np.dtype(np.uint8), total)
        self._check_arrays(n, total)

    def _corrupt(self, file: str, problem: str) -> CorruptStoreError:
        return CorruptStoreError(self.path, file, problem, self.meta.get("kind"))

    def _check_files(self, verify_checksums: bool) -> None:
        """Every array file exists, the .bin sizes match meta, and (optionally) the checksums."""
        total = int(self.meta["num_tokens"])
        sums = self.meta.get("checksums") or {}
        expected_size = {
            "input_ids.bin": total * np.dtype(self.meta["id_dtype"]).itemsize,
            "loss_mask.bin": total,
        }
        for name in ARRAY_FILES:
            file = self.path / name
            if not file.is_file():
                raise self._corrupt(name, "the file is missing")
            size = file.stat().st_size
            if name in expected_size and size != expected_size[name]:
                raise self._corrupt(name, f"{size} bytes, but meta.json records {total} tokens "
                                          f"({expected_size[name]} bytes)")
            if verify_checksums:
                if name not in sums:
                    raise self._corrupt(META, f"no checksum recorded for {name}")
                if file_checksum(file) != sums[name]:
                    raise self._corrupt(name, "its checksum differs from the one recorded at build")

    def _check_arrays(self, n: int, total: int) -> None:
        """Sizes and sums of the index arrays agree with each other and with meta.json (O(n))."""
        for name, arr, want in (("lengths.npy", self.lengths, n), ("offsets.npy", self.offsets, n + 1),
                                ("loss_token_counts.npy", self.loss_token_counts, n),
                                ("record_lines.npy", self.record_lines, n)):
            if arr.ndim != 1 or len(arr) != want:
                raise self._corrupt(name, f"shape {arr.shape}, but meta.json records {n} examples "
                                          f"(expected ({want},))")
        if n == 0:
            return
        offsets = np.asarray(self.offsets)
        lengths = np.asarray(self.lengths, dtype=np.int64)
        if offsets[0] != 0 or offsets[-1] != total:
            raise self._corrupt("offsets.npy", f"runs from {offsets[0]} to {offsets[-1]}, "
                                               f"expected 0 to {total} tokens")
        if not np.array_equal(np.diff(offsets), lengths):
            bad = int(np.flatnonzero(np.diff(offsets) != lengths)[0])
            raise self._corrupt("lengths.npy", f"example {bad} has length {lengths[bad]} but "
                                               f"offsets.npy spans {offsets[bad + 1] - offsets[bad]} tokens")
        counts = np.asarray(self.loss_token_counts, dtype=np.int64)
        if counts.min() < 0 or np.any(counts > np.maximum(lengths - 1, 0)):
            bad = int(np.flatnonzero((counts < 0) | (counts > np.maximum(lengths - 1, 0)))[0])
            raise self._corrupt("loss_token_counts.npy", f"example {bad} has {counts[bad]} loss "
                                f"tokens, outside [0, length - 1 = {lengths[bad] - 1}]")
        recorded = self.meta.get("num_loss_tokens")
        if recorded is None or int(counts.sum()) != int(recorded):
            raise self._corrupt("loss_token_counts.npy", f"sums to {int(counts.sum())} loss tokens, "
                                f"but meta.json records {recorded}")

    def __len__(self) -> int:
        return len(self.lengths)

    def __getstate__(self) -> dict[str, str]:
        # pickle the location, not the mapped arrays (DataLoader workers reopen the maps)
        return {"path": str(self.path)}

    def __setstate__(self, state: dict[str, str]) -> None:
        # the opening process verified the checksums; a worker repeats only the cheap checks
        self.__init__(state["path"], verify_checksums=False)  # type: ignore[misc]

    def token_span(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and loss mask of flat positions ``[a, b)`` (memory-mapped views)."""
        return self._ids[a:b], self._mask[a:b]

    def get(self, i: int) -> dict[str, np.ndarray]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return {
            "input_ids": np.array(self._ids[a:b], dtype=np.int64),
            "loss_mask": np.array(self._mask[a:b], dtype=np.uint8),
        }


def _memmap(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    if count == 0:  # np.memmap cannot map an empty file
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


def drop_partial_writes(final_path: str | os.PathLike[str]) -> None:
    """Remove the temporary directories that writers of ``final_path`` left (a writer that
    died before its commit). Only the process that owns the right to write ``final_path``
    (its lock) may call this."""
    final = Path(final_path)
    for partial in final.parent.glob(f".{final.name}.*"):
        if partial.is_dir():
            shutil.rmtree(partial, ignore_errors=True)


class StoreWriter:
    """Append examples chunk by chunk, then :meth:`commit` atomically to ``final_path``."""

    def __init__(self, final_path: str | os.PathLike[str]) -> None:
        self.final_path = Path(final_path)
        self.final_path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.final_path.name}.", dir=self.final_path.parent))
        self._ids = open(self.tmp / "input_ids.bin", "wb")  # noqa: SIM115 (closed in commit/abort)
        self._mask = open(self.tmp / "loss_mask.bin", "wb")  # noqa: SIM115
        self._lengths: list[np.ndarray] = []
        self._counts: list[np.ndarray] = []
        self._lines: list[np.ndarray] = []

    def append(self, ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray, lines: np.ndarray) -> None:
        """Append flat ids/masks of several examples with their lengths and source lines."""
        ids = np.ascontiguousarray(ids, dtype=ID_DTYPE)
        mask = np.ascontiguousarray(mask, dtype=np.uint8)
        lengths = np.asarray(lengths, dtype=np.int64)
        if len(ids) != len(mask) or len(ids) != int(lengths.sum()):
            raise ValueError("ids, mask and lengths disagree")
        self._ids.write(ids.tobytes())
        self._mask.write(mask.tobytes())
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
        csum = np.concatenate(([0], np.cumsum(mask, dtype=np.int64)))
        # loss targets: positions t >= 1 of each example with mask 1
        counts = csum[starts + lengths] - csum[np.minimum(starts + 1, starts + lengths)]
        self._lengths.append(lengths.astype(np.int32))
        self._counts.append(counts.astype(np.int32))
        self._lines.append(np.asarray(lines, dtype=np.int64))

    def commit(self, meta: dict[str, Any]) -> TokenStore:
        """Write the index arrays and meta, then move the store into place."""
        self._ids.close()
        self._mask.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        counts = np.concatenate(self._counts) if self._counts else np.zeros(0, np.int32)
        lines = np.concatenate(self._lines) if self._lines else np.zeros(0, np.int64)
        offsets = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64))).astype(np.int64)
        np.save(self.tmp / "lengths.npy", lengths)
        np.save(self.tmp / "loss_token_counts.npy", counts)
        np.save(self.tmp / "record_lines.npy", lines)
        np.save(self.tmp / "offsets.npy", offsets)
        full_meta = {
            "format": FORMAT,
            "version": VERSION,
            "id_dtype": np.dtype(ID_DTYPE).name,
            "num_examples": len(lengths),
            "num_tokens": int(offsets[-1]),
            "num_loss_tokens": int(counts.sum(dtype=np.int64)),
            "checksums": {name: file_checksum(self.tmp / name) for name in ARRAY_FILES},
            **meta,
        }
        (self.tmp / META).write_text(json.dumps(full_meta, indent=1, sort_keys=True))
        if self.final_path.exists():
            shutil.rmtree(self.final_path)
        os.replace(self.tmp, self.final_path)
        return TokenStore(self.final_path)

    def abort(self) -> None:
        """Drop the partial store."""
        self._ids.close()
        self._mask.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
