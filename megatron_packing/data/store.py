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
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "megatron_packing.sft_tokens"
VERSION = 1
META = "meta.json"
ID_DTYPE = np.int32


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

    def __init__(self, path: str | os.PathLike[str]) -> None:
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
        n, total = int(meta["num_examples"]), int(meta["num_tokens"])
        self.offsets = np.load(self.path / "offsets.npy", mmap_mode="r")
        self.lengths = np.load(self.path / "lengths.npy", mmap_mode="r")
        self.loss_token_counts = np.load(self.path / "loss_token_counts.npy", mmap_mode="r")
        self.record_lines = np.load(self.path / "record_lines.npy", mmap_mode="r")
        self._ids = _memmap(self.path / "input_ids.bin", np.dtype(meta["id_dtype"]), total)
        self._mask = _memmap(self.path / "loss_mask.bin", np.dtype(np.uint8), total)
        if len(self.lengths) != n or len(self.offsets) != n + 1:
            raise ValueError(f"{self.path}: array sizes disagree with meta.json; rebuild it")

    def __len__(self) -> int:
        return len(self.lengths)

    def __getstate__(self) -> dict[str, str]:
        # pickle the location, not the mapped arrays (DataLoader workers reopen the maps)
        return {"path": str(self.path)}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.__init__(state["path"])  # type: ignore[misc]

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
