"""Tokenize raw records chunk by chunk, in order, optionally in a fork pool, and tally what
was skipped: the work of one length-index build (whole, or one part of a shared build)."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import BadRecordError, RecordProblem
from .records import Messages, RawItem, parse_json_line, record_to_messages
from .tokenize import ChatEncoder

MAX_SKIP_EXAMPLES = 20
BATCH = 256  # conversations per tokenizer call
CHUNK = 2048  # records per worker task
PARALLEL_MIN_RECORDS = 20_000  # fewer records are tokenized in one process by default


def default_num_proc(total: int | None, processes_per_host: int = 1) -> int:
    """Tokenizer processes for a build of ``total`` records when none are asked for: one for
    small inputs, else this host's CPUs shared by ``processes_per_host`` builders, at most 8."""
    if (total or 0) < PARALLEL_MIN_RECORDS:
        return 1
    return max(1, min((os.cpu_count() or 1) // max(processes_per_host, 1), 8))


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


_WORKER_ENCODER: ChatEncoder | None = None


def _worker_encode(args: tuple[list[RawItem], bool]) -> ChunkResult:
    assert _WORKER_ENCODER is not None
    return encode_chunk(_WORKER_ENCODER, *args)


def chunks(items: Iterable[RawItem], size: int) -> Iterator[list[RawItem]]:
    """``items`` in lists of ``size`` (the last may be shorter)."""
    chunk: list[RawItem] = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def ordered_results(
    items: Iterable[RawItem], raw_is_text: bool, encoder: ChatEncoder, num_proc: int
) -> Iterator[tuple[int, ChunkResult]]:
    """(records, result) per chunk, in order; with ``num_proc > 1`` a bounded window of
    chunks runs in a fork pool."""
    if num_proc <= 1:
        for chunk in chunks(items, CHUNK):
            yield len(chunk), encode_chunk(encoder, chunk, raw_is_text)
        return
    global _WORKER_ENCODER
    _WORKER_ENCODER = encoder  # inherited by forked workers
    ctx = mp.get_context("fork")
    pool = ctx.Pool(num_proc)
    try:
        pending: deque[tuple[int, Any]] = deque()
        for chunk in chunks(items, CHUNK):
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


@dataclass
class SkipTally:
    """Bad records of a build, counted by reason, with the first `MAX_SKIP_EXAMPLES` of them
    (in record order) and the records holding a control token's text."""

    source: str
    on_bad_record: str
    skipped: Counter[str] = field(default_factory=Counter)
    examples: list[dict[str, Any]] = field(default_factory=list)
    special_records: int = 0

    def add(self, res: ChunkResult) -> None:
        """Count one chunk's bad records; in ``error`` mode the first one raises."""
        if res.bad and self.on_bad_record == "error":
            line, reason, detail = res.bad[0]
            raise BadRecordError(self.source, line, reason, detail)
        for line, reason, detail in res.bad:
            self.skipped[reason] += 1
            if len(self.examples) < MAX_SKIP_EXAMPLES:
                self.examples.append({"source": self.source, "line": line, "reason": reason,
                                      "detail": detail})
        self.special_records += res.special_text_records

    def add_recorded(self, meta: dict[str, Any]) -> None:
        """Count what a finished part's meta recorded (`meta` gives that form), as if its
        chunks had been added here in order."""
        self.skipped.update(meta.get("skipped") or {})
        room = MAX_SKIP_EXAMPLES - len(self.examples)
        self.examples.extend((meta.get("skipped_examples") or [])[:max(room, 0)])
        self.special_records += int(meta.get("special_token_records", 0))

    def meta(self) -> dict[str, Any]:
        return {"skipped": dict(self.skipped), "skipped_examples": self.examples,
                "special_token_records": self.special_records}


__all__ = ["BATCH", "CHUNK", "MAX_SKIP_EXAMPLES", "PARALLEL_MIN_RECORDS", "ChunkResult",
           "SkipTally", "chunks", "default_num_proc", "encode_chunk", "ordered_results"]
