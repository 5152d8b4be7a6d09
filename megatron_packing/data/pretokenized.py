"""Save an SFTDataset as pre-tokenized data, and check such data on load.

The format is a token-store directory (see :mod:`~megatron_packing.data.store`): flat ``.bin``
arrays of ids and loss masks, ``.npy`` offsets/lengths/counts and a JSON header. No pickle.
Pass the directory to ``load_sft_dataset`` like any other source.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from .dataset import SFTDataset
from .store import StoreWriter, TokenStore

SAVE_CHUNK = 4096


def save_pretokenized(ds: SFTDataset, path: str | os.PathLike[str]) -> Path:
    """Write ``ds`` (in its order) to directory ``path``; returns the path."""
    path = Path(path)
    writer = StoreWriter(path)
    h = hashlib.blake2b(digest_size=16)
    try:
        for start in range(0, len(ds), SAVE_CHUNK):
            items = [ds[i] for i in range(start, min(start + SAVE_CHUNK, len(ds)))]
            ids = np.concatenate([x["input_ids"] for x in items])
            mask = np.concatenate([x["loss_mask"] for x in items])
            lengths = np.array([len(x["input_ids"]) for x in items], dtype=np.int64)
            for arr in (ids.astype(np.int32), mask, lengths):
                h.update(arr.tobytes())
            writer.append(ids, mask, lengths, np.arange(start, start + len(items)) + 1)
    except BaseException:
        writer.abort()
        raise
    opts = ds.options
    writer.commit({
        "kind": "pretokenized",
        "key": h.hexdigest(),
        "source": f"pre-tokenized from dataset {ds.fingerprint}",
        "tokenizer_fingerprint": opts.get("tokenizer_fingerprint"),
        "loss_on": opts.get("loss_on"),
        "max_length": opts.get("max_length"),
        "truncate": opts.get("truncate", True),
        "skipped": dict(ds.skipped),
        "skipped_examples": [],
    })
    return path


def check_pretokenized(store: TokenStore, options: dict[str, Any]) -> None:
    """Refuse stored data whose tokenizer or options differ from the requested ones."""
    meta = store.meta
    fp = options.get("tokenizer_fingerprint")
    if fp is not None and meta.get("tokenizer_fingerprint") not in (None, fp):
        raise ValueError(
            f"pre-tokenized data {store.path} was made with a different tokenizer or chat template; "
            "pass tokenizer=None to use its token ids as stored, or re-tokenize from the source records"
        )
    for opt in ("loss_on", "max_length"):
        want, have = options.get(opt), meta.get(opt)
        if opt == "max_length" and want is None:
            continue
        if have is not None and want != have:
            raise ValueError(
                f"pre-tokenized data {store.path} was built with {opt}={have!r} but {opt}={want!r} "
                f"was requested; pass {opt}={have!r} or re-tokenize from the source records"
            )


def pretokenized_without_targets(store: TokenStore, on_bad_record: str) -> np.ndarray | None:
    """Rows of a pre-tokenized store with no next-token target (``loss_mask[1:]`` all 0).

    A store written by `save_pretokenized` has none (the build refused them); one written by
    other tools may. ``on_bad_record='error'`` raises `BadRecordError` (``no_loss_tokens``) at
    the first; ``'skip'`` returns the rows to leave out (None when there are none).
    """
    from .errors import BadRecordError

    rows = np.flatnonzero(np.asarray(store.loss_token_counts) <= 0)
    if rows.size == 0:
        return None
    if on_bad_record == "error":
        first = int(rows[0])
        raise BadRecordError(
            str(store.path), int(store.record_lines[first]), "no_loss_tokens",
            f"pre-tokenized example {first} has {int(store.lengths[first])} token(s) and no "
            f"loss target after the first position ({rows.size} such examples in the store)")
    return rows


def drop_rows(sizes: list[int], part: np.ndarray | None, local: np.ndarray | None,
              dropped: dict[int, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The (store, row) selection without the ``dropped`` rows of each store."""
    if part is None or local is None:
        part = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
        local = np.concatenate([np.arange(n, dtype=np.int64) for n in sizes])
    keep = np.ones(len(part), dtype=bool)
    for k, rows in dropped.items():
        keep &= ~((part == k) & np.isin(local, rows))
    return part[keep], local[keep]
