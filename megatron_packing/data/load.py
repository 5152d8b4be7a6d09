"""load_sft_dataset: sources + tokenizer -> cached, memory-mapped SFTDataset."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .blend import blend_indices, validate_weights
from .dataset import SFTDataset
from .errors import ON_BAD_RECORD_CHOICES, check_choice
from .length_index import build_or_load, default_cache_dir, hash_file, hash_rows
from .pretokenized import check_pretokenized, drop_rows, pretokenized_without_targets
from .records import count_jsonl_lines, iter_jsonl, read_json_list
from .store import TokenStore, is_store
from .tokenize import ChatEncoder, load_tokenizer, tokenizer_fingerprint

log = logging.getLogger(__name__)

SUPPORTED = "a .jsonl or .json file, a pre-tokenized directory, or a datasets.Dataset"


def _is_dataset(obj: Any) -> bool:
    """Duck-typed Hugging Face ``datasets.Dataset`` (rows iterable as dicts)."""
    return hasattr(obj, "column_names") and hasattr(obj, "__iter__") and hasattr(obj, "__len__")


def _is_source(obj: Any) -> bool:
    return isinstance(obj, (str, os.PathLike)) or _is_dataset(obj)


def normalize_sources(sources: Any, weights: Any) -> tuple[list[Any], list[float] | None]:
    """Split the accepted ``sources`` shapes into (list of sources, weights or None)."""
    if _is_source(sources):
        if weights is not None:
            raise ValueError("weights need several sources: pass a list of sources or a {path: weight} dict")
        return [sources], None
    if isinstance(sources, Mapping):
        if weights is not None:
            raise ValueError("pass weights either in the sources dict or as weights=, not both")
        items = list(sources.items())
        return [s for s, _ in items], validate_weights([w for _, w in items], len(items))
    if isinstance(sources, Sequence) and not isinstance(sources, (bytes, str)):
        srcs = list(sources)
        if not srcs:
            raise ValueError(f"sources is empty; give {SUPPORTED}, or a list of them")
        pairs = [isinstance(s, tuple) and len(s) == 2 and _is_source(s[0]) for s in srcs]
        if all(pairs):
            if weights is not None:
                raise ValueError("pass weights either as (source, weight) pairs or as weights=, not both")
            return [s for s, _ in srcs], validate_weights([w for _, w in srcs], len(srcs))
        for s in srcs:
            if not _is_source(s):
                raise ValueError(
                    f"source {s!r} is not valid; give {SUPPORTED}, a list of them, a list of "
                    "(source, weight) pairs or a {source: weight} dict"
                )
        return srcs, None if weights is None else validate_weights(list(weights), len(srcs))
    raise ValueError(f"sources={sources!r} is not valid; give {SUPPORTED}, or a list/dict of them")


def load_sft_dataset(
    sources: Any,
    tokenizer: Any,
    *,
    loss_on: str = "assistant",
    on_bad_record: str = "error",
    cache_dir: str | os.PathLike[str] | None = None,
    max_length: int | None = None,
    weights: Sequence[float] | None = None,
    seed: int = 0,
    num_proc: int | None = None,
    show_progress: bool = True,
    truncate: bool = True,
    special_tokens_in_content: str = "split",
    build_sharers: int | None = None,
) -> SFTDataset:
    """Tokenize (or load cached) SFT sources into an :class:`SFTDataset`.

    Args:
        sources: a path to a ``.jsonl``/``.json`` file or a pre-tokenized directory, a
            ``datasets.Dataset``, a list of those (concatenated), or a weighted blend given as
            ``[(source, weight), ...]``, ``{source: weight}`` or a list plus ``weights``.
        tokenizer: a transformers tokenizer or a local tokenizer directory (loaded offline).
            May be ``None`` when every source is pre-tokenized.
        loss_on: ``"assistant"``, ``"all"`` or ``"last_assistant_turn"``.
        on_bad_record: ``"error"`` raises :class:`BadRecordError` at the first bad record;
            ``"skip"`` skips, counts (``ds.skipped``) and logs a warning summary.
        cache_dir: where length-index cache entries live (default :func:`default_cache_dir`).
        max_length: keep the first ``max_length`` tokens of longer examples (``truncate=True``)
            or treat them as bad records ``too_long`` (``truncate=False``).
        weights: blend weights when ``sources`` is a plain list.
        seed: blend seed.
        num_proc: tokenizer processes (default: 1 for small inputs, else up to the CPU count).
        show_progress: tqdm progress bar while building an index.
        truncate: with ``max_length``, ``False`` makes longer examples bad records.
        special_tokens_in_content: control-token text (e.g. ``<|im_start|>``) inside message
            content: ``"split"`` tokenizes it as plain text, ``"keep"`` as the control token,
            ``"error"`` makes the record bad. Affected records are counted either way
            (``ds.special_token_records``).
        build_sharers: how many processes load these sources at the same time (a job's
            ranks); above 1, a missing cache entry is built by all of them, each tokenizing
            parts of it (see `megatron_packing.data.shared_build`). Default: ``$WORLD_SIZE``
            when set, else 1. Not part of the cache key: the entry is the same either way.
    """
    check_choice("on_bad_record", on_bad_record, ON_BAD_RECORD_CHOICES)
    sharers = _build_sharers(build_sharers)
    srcs, blend_weights = normalize_sources(sources, weights)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()

    encoder = fp = None
    options: dict[str, Any] = {"loss_on": loss_on, "max_length": max_length, "truncate": truncate,
                               "special_tokens_in_content": special_tokens_in_content}
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
        encoder = ChatEncoder(tok, loss_on=loss_on, max_length=max_length, truncate=truncate,
                              special_tokens_in_content=special_tokens_in_content)
        fp = tokenizer_fingerprint(tok)
        options.update(tokenizer_fingerprint=fp, method=encoder.method)
    else:
        ChatEncoder.check_options(loss_on, max_length, special_tokens_in_content)

    stores: list[TokenStore] = []
    untrainable_rows: dict[int, Any] = {}  # pre-tokenized rows without a target (skipped)
    for src in srcs:
        if isinstance(src, (str, os.PathLike)) and is_store(src):
            store = TokenStore(src)
            check_pretokenized(store, options)
            untrainable = pretokenized_without_targets(store, on_bad_record)
            if untrainable is not None:
                untrainable_rows[len(stores)] = untrainable
        else:
            if encoder is None or fp is None:
                raise ValueError(f"source {src!r} needs a tokenizer; tokenizer=None only works for pre-tokenized data")
            store = _load_raw(src, encoder, fp, cache, on_bad_record, num_proc, show_progress,
                              sharers)
        stores.append(store)

    if tokenizer is None and stores:
        options["tokenizer_fingerprint"] = stores[0].meta.get("tokenizer_fingerprint")
    # store keys already cover data, tokenizer, template and options
    keys: dict[str, Any] = {"stores": [s.meta["key"] for s in stores]}
    part = local = None
    if blend_weights is not None:
        part, local = blend_indices([len(s) for s in stores], blend_weights, seed)
        keys.update(weights=blend_weights, seed=seed)
    extra_skipped: dict[str, int] = {}
    if untrainable_rows:
        part, local = drop_rows([len(s) for s in stores], part, local, untrainable_rows)
        extra_skipped = {"no_loss_tokens": sum(len(r) for r in untrainable_rows.values())}
        keys.update(dropped={k: v.tolist() for k, v in untrainable_rows.items()})
    fingerprint = hashlib.blake2b(json.dumps(keys, sort_keys=True).encode(), digest_size=16).hexdigest()
    ds = SFTDataset(stores, part_ids=part, local_ids=local, options=options, fingerprint=fingerprint,
                    extra_skipped=extra_skipped)
    _warn_skipped(stores)
    return ds


def _build_sharers(given: int | None) -> int:
    """``build_sharers`` as given, else ``$WORLD_SIZE``, else 1; anything else is refused."""
    if given is None:
        world = os.environ.get("WORLD_SIZE", "1")
        try:
            return max(int(world), 1)
        except ValueError:
            raise ValueError(f"WORLD_SIZE={world!r} is not a process count; unset it or pass "
                             "build_sharers= explicitly") from None
    if isinstance(given, bool) or not isinstance(given, int) or given < 1:
        raise ValueError(f"build_sharers={given!r} is not valid; give a process count >= 1")
    return given


def _load_raw(
    src: Any, encoder: ChatEncoder, fp: str, cache: Path, on_bad_record: str,
    num_proc: int | None, show_progress: bool, sharers: int,
) -> TokenStore:
    common: dict[str, Any] = dict(encoder=encoder, tokenizer_fp=fp, cache_dir=cache,
                                  on_bad_record=on_bad_record, num_proc=num_proc,
                                  show_progress=show_progress, sharers=sharers)
    if _is_dataset(src):
        if isinstance(src.column_names, Mapping):
            raise ValueError("got a dataset dictionary; pass one split, e.g. dataset_dict['train']")
        name = getattr(getattr(src, "info", None), "dataset_name", None) or "dataset"
        return build_or_load(
            name=f"dataset-{name}", source=f"<dataset {name}> row", data_hash=hash_rows(iter(src)),
            items=lambda: enumerate(iter(src), start=1), total=len(src), raw_is_text=False,
            **common,
        )
    path = Path(src)
    if not path.exists():
        raise FileNotFoundError(f"SFT source {str(path)!r} does not exist")
    if path.is_dir():
        raise ValueError(f"{path} is a directory but not pre-tokenized data (no valid meta.json); give {SUPPORTED}")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        items, total, is_text = (lambda: iter_jsonl(path)), (lambda: count_jsonl_lines(path)), True
    elif suffix == ".json":
        records = read_json_list(path, str(path))
        count = len(records)
        items, total, is_text = (lambda: iter(records)), (lambda: count), False
    else:
        raise ValueError(f"{path}: unsupported file type {suffix!r}; give {SUPPORTED}")
    return build_or_load(
        name=path.name, source=str(path), data_hash=hash_file(path, memo_dir=cache),
        items=items, total=total, raw_is_text=is_text, **common,
    )


def _warn_skipped(stores: list[TokenStore]) -> None:
    for store in stores:
        skipped = store.meta.get("skipped") or {}
        if not skipped:
            continue
        reasons = ", ".join(f"{r}={n}" for r, n in sorted(skipped.items()))
        first = "; ".join(
            f"{e['source']}:{e['line']} {e['reason']}" for e in store.meta.get("skipped_examples", [])[:3]
        )
        log.warning(
            "skipped %d bad record(s) in %s (%s); first: %s",
            sum(skipped.values()), store.meta.get("source"), reasons, first,
        )
