"""Render conversations with the tokenizer's chat template and build loss masks.

Two ways to find the assistant tokens:

* **Generation tags** (preferred): when the template wraps assistant turns in
  ``{% generation %} ... {% endgeneration %}``, the tokenizer itself returns the mask
  (``apply_chat_template(..., return_assistant_tokens_mask=True, return_dict=True)``).
* **Prefix fallback**: otherwise each assistant message *i* is located by rendering the
  conversation up to *i* with ``add_generation_prompt=True`` (the prompt) and up to and
  including *i* (prompt + turn). The characters between the two renderings are that turn, as
  the template writes it (content plus end-of-turn text). The full rendering is tokenized once,
  with offsets, and every token overlapping such a character span is marked. The template
  must render a conversation's prefixes as prefixes of the full text; when it does not, the
  record fails with ``template_error`` and the fix is to add generation tags.

Both ways mark tokens that overlap the assistant characters, so they agree on the same
template (tests check it).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import LOSS_ON_CHOICES, RecordProblem, check_choice
from .records import Messages

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

Encoded = tuple[np.ndarray, np.ndarray]
"""(token ids int32, loss mask uint8) of one example."""


def load_tokenizer(tokenizer: Any) -> Any:
    """Return a tokenizer object; a path is loaded offline from a local directory."""
    if hasattr(tokenizer, "apply_chat_template"):
        return tokenizer
    import os

    from transformers import AutoTokenizer

    path = os.fspath(tokenizer)
    if not os.path.isdir(path):
        raise ValueError(f"tokenizer {path!r} is neither a tokenizer object nor a local directory")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def get_template(tokenizer: Any) -> str:
    """The tokenizer's chat template; a clear error when it has none."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    if not isinstance(template, str) or not template:
        raise ValueError(
            "the tokenizer has no chat template; set tokenizer.chat_template to a Jinja template "
            "(ideally with {% generation %} tags around assistant turns)"
        )
    return template


def has_generation_tags(template: str) -> bool:
    """Whether the template marks assistant turns with ``{% generation %}``."""
    return bool(_GENERATION_TAG.search(template))


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Stable hash of the tokenizer's vocabulary/serialization, special tokens and template."""
    h = hashlib.blake2b(digest_size=16)
    h.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(getattr(tokenizer, "special_tokens_map", {}), sort_keys=True, default=str).encode())
    h.update(b"\0template\0" + get_template(tokenizer).encode())
    return h.hexdigest()


class ChatEncoder:
    """Turn validated message lists into (ids, loss mask) with one loss policy.

    ``loss_on``: ``"assistant"`` (every assistant turn), ``"all"`` (every token) or
    ``"last_assistant_turn"``. ``max_length``: keep the first ``max_length`` tokens when
    ``truncate`` is true, else reject longer examples as ``too_long``. An example left with no
    loss target (``mask[1:].sum() == 0``) is rejected as ``no_loss_tokens``.
    """

    def __init__(
        self,
        tokenizer: Any,
        loss_on: str = "assistant",
        max_length: int | None = None,
        truncate: bool = True,
        force_fallback: bool = False,
    ) -> None:
        self.check_options(loss_on, max_length)
        self.tokenizer = tokenizer
        self.loss_on = loss_on
        self.max_length = max_length
        self.truncate = truncate
        self.template = get_template(tokenizer)
        self.use_tags = has_generation_tags(self.template) and not force_fallback

    @staticmethod
    def check_options(loss_on: str, max_length: int | None) -> None:
        """Raise ValueError for an unknown ``loss_on`` or a bad ``max_length``."""
        check_choice("loss_on", loss_on, LOSS_ON_CHOICES)
        if max_length is not None and (
            isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2
        ):
            raise ValueError(f"max_length must be an int >= 2 or None, got {max_length!r}")

    @property
    def method(self) -> str:
        return "generation_tags" if self.use_tags else "prefix_fallback"

    # -- public -------------------------------------------------------------------------
    def encode(self, messages: Messages) -> Encoded:
        """Encode one conversation; raise :class:`RecordProblem` if it cannot be used."""
        result = self.encode_batch([messages])[0]
        if isinstance(result, RecordProblem):
            raise result
        return result

    def encode_batch(self, batch: Sequence[Messages]) -> list[Encoded | RecordProblem]:
        """Encode many conversations at once (one tokenizer call); problems are returned."""
        if not batch:
            return []
        try:
            raw = self._encode_raw(batch)
        except RecordProblem:
            raw = None
        except Exception:  # a template error in one conversation fails the whole batch
            raw = None
        if raw is None:
            if len(batch) == 1:
                try:
                    raw = self._encode_raw(batch)
                except RecordProblem as exc:
                    return [exc]
                except Exception as exc:
                    return [RecordProblem("template_error", f"{type(exc).__name__}: {exc}")]
            else:
                out: list[Encoded | RecordProblem] = []
                for messages in batch:
                    out.extend(self.encode_batch([messages]))
                return out
        return [self._finish(ids, mask) for ids, mask in raw]

    # -- internals ----------------------------------------------------------------------
    def _finish(self, ids: np.ndarray, mask: np.ndarray) -> Encoded | RecordProblem:
        if self.max_length is not None and len(ids) > self.max_length:
            if not self.truncate:
                return RecordProblem(
                    "too_long", f"{len(ids)} tokens > max_length={self.max_length} (truncation is off)"
                )
            ids, mask = ids[: self.max_length], mask[: self.max_length]
        if int(mask[1:].sum()) == 0:
            return RecordProblem(
                "no_loss_tokens",
                f"no loss target among {len(ids)} tokens with loss_on={self.loss_on!r}"
                + (f" after truncation to {self.max_length}" if self.max_length else ""),
            )
        return ids, mask

    def _encode_raw(self, batch: Sequence[Messages]) -> list[Encoded]:
        tok = self.tokenizer
        if self.loss_on == "all":
            out = tok.apply_chat_template(list(batch), tokenize=True, return_dict=True)
            return [
                (np.asarray(ids, dtype=np.int32), np.ones(len(ids), dtype=np.uint8))
                for ids in out["input_ids"]
            ]
        if self.use_tags:
            return self._encode_tags(batch)
        return self._encode_prefix(batch)

    def _encode_tags(self, batch: Sequence[Messages]) -> list[Encoded]:
        out = self.tokenizer.apply_chat_template(
            list(batch), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        result = []
        for messages, ids, mask in zip(batch, out["input_ids"], out["assistant_masks"], strict=True):
            ids_arr = np.asarray(ids, dtype=np.int32)
            mask_arr = np.asarray(mask, dtype=np.uint8)
            if self.loss_on == "last_assistant_turn":
                n_turns = sum(m["role"] == "assistant" for m in messages)
                starts, ends = _runs(mask_arr)
                if len(starts) != n_turns:  # turns touch: locate them by prefixes instead
                    ids_arr, mask_arr = self._encode_prefix([messages])[0]
                else:
                    mask_arr = np.zeros_like(mask_arr)
                    mask_arr[starts[-1] : ends[-1]] = 1
            result.append((ids_arr, mask_arr))
        return result

    def _render(self, messages: Messages, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _assistant_spans(self, messages: Messages, full: str) -> list[tuple[int, int]]:
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = self._render(messages[:i], True) if i else self._render_empty_prompt()
            turn = self._render(messages[: i + 1], False)
            if not turn.startswith(prompt) or not full.startswith(turn):
                raise RecordProblem(
                    "template_error",
                    f"the chat template does not render message {i}'s prefix as a prefix of the "
                    "conversation, so assistant tokens cannot be located; add {% generation %} "
                    "tags to the template",
                )
            spans.append((len(prompt), len(turn)))
        if self.loss_on == "last_assistant_turn":
            spans = spans[-1:]
        return spans

    def _render_empty_prompt(self) -> str:
        try:
            return self._render([], True)
        except Exception:
            return ""

    def _encode_prefix(self, batch: Sequence[Messages]) -> list[Encoded]:
        fulls = [self._render(messages, False) for messages in batch]
        spans = [self._assistant_spans(m, full) for m, full in zip(batch, fulls, strict=True)]
        enc = self.tokenizer(fulls, add_special_tokens=False, return_offsets_mapping=True)
        result = []
        for ids, offsets, conv_spans in zip(enc["input_ids"], enc["offset_mapping"], spans, strict=True):
            off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
            mask = np.zeros(len(ids), dtype=bool)
            for a, b in conv_spans:
                mask |= (off[:, 0] < b) & (off[:, 1] > a)
            result.append((np.asarray(ids, dtype=np.int32), mask.astype(np.uint8)))
        return result


def _runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and end (exclusive) positions of the runs of ones in a 0/1 array."""
    padded = np.concatenate(([0], mask.astype(np.int8), [0]))
    diff = np.diff(padded)
    return np.flatnonzero(diff == 1), np.flatnonzero(diff == -1)
