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

import functools
import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

import jinja2
import numpy as np

from megatron_packing.common.validation import require_int

from .errors import LOSS_ON_CHOICES, SPECIAL_TOKENS_IN_CONTENT_CHOICES, RecordProblem, check_choice
from .records import Conversation, Messages

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
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises many kinds for a broken directory
        files = ", ".join(sorted(os.listdir(path))[:8]) or "no files"
        raise ValueError(
            f"tokenizer directory {path!r} cannot be loaded ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else 'no detail'}); it holds {files}: "
            "check that its files (tokenizer.json, tokenizer_config.json) are complete and "
            "readable") from None


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


# Errors the template engine or the tokenizer raise for one record's content (a missing key,
# a None where the template expects text, raise_exception(...) in the template). Anything else
# raised while encoding is a bug and propagates.
_RECORD_ERRORS: tuple[type[BaseException], ...] = (jinja2.TemplateError, TypeError, ValueError)

# Private-use characters that bracket control-token text found in message content, so its
# position in the rendered conversation is known ("split" mode).
_MARK_START, _MARK_END = "\ue000", "\ue001"


class ChatEncoder:
    """Turn validated conversations into (ids, loss mask) with one loss policy.

    ``loss_on``: ``"assistant"`` (every assistant turn), ``"all"`` (every token) or
    ``"last_assistant_turn"``. ``max_length``: keep the first ``max_length`` tokens when
    ``truncate`` is true, else reject longer examples as ``too_long``. An example left with no
    loss target (``mask[1:].sum() == 0``) is rejected as ``no_loss_tokens``.

    ``special_tokens_in_content``: what to do with the text of a special (control) token, such
    as ``<|im_start|>``, inside a message's content. ``"split"`` (default) tokenizes it as plain
    text, so content cannot forge a turn; ``"keep"`` tokenizes it as the control token;
    ``"error"`` makes the record bad (``special_token_in_content``). :meth:`has_special_text`
    tells which records are affected (the build counts them).

    Tool calls (``tool_calls`` on assistant messages, a record's ``tools``) are rendered by the
    template when it reads them; a template that never mentions ``tool_calls`` (or ``tools``)
    would drop them silently, so such records are bad (``tools_unsupported``).
    """

    def __init__(
        self,
        tokenizer: Any,
        loss_on: str = "assistant",
        max_length: int | None = None,
        truncate: bool = True,
        force_fallback: bool = False,
        special_tokens_in_content: str = "split",
    ) -> None:
        self.check_options(loss_on, max_length, special_tokens_in_content)
        self.tokenizer = tokenizer
        self.loss_on = loss_on
        self.max_length = max_length
        self.truncate = truncate
        self.special_tokens_in_content = special_tokens_in_content
        self.template = get_template(tokenizer)
        self.use_tags = has_generation_tags(self.template) and not force_fallback
        self.renders_tool_calls = "tool_calls" in self.template
        self.renders_tools = bool(re.search(r"\btools\b", self.template))
        specials = sorted({t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                           if getattr(t, "special", False)} | set(tokenizer.all_special_tokens),
                          key=len, reverse=True)
        # Longest first, so a token is not matched by a shorter one it starts with; "(?!)"
        # (matches nothing) when the tokenizer has no special tokens.
        self._special_re = re.compile("|".join(map(re.escape, specials)) if specials else "(?!)")

    @staticmethod
    def check_options(loss_on: str, max_length: int | None,
                      special_tokens_in_content: str = "split") -> None:
        """Raise ValueError for an unknown ``loss_on`` / ``special_tokens_in_content`` or a bad ``max_length``."""
        check_choice("loss_on", loss_on, LOSS_ON_CHOICES)
        check_choice("special_tokens_in_content", special_tokens_in_content,
                     SPECIAL_TOKENS_IN_CONTENT_CHOICES)
        require_int("max_length", max_length, minimum=2, allow_none=True, error=ValueError)

    @property
    def method(self) -> str:
        return "generation_tags" if self.use_tags else "prefix_fallback"

    def has_special_text(self, messages: Messages) -> bool:
        """Whether some message content contains a special token's text."""
        return any(isinstance(m.get("content"), str) and self._special_re.search(m["content"])
                   for m in messages)

    # -- public -------------------------------------------------------------------------
    def encode(self, messages: Messages) -> Encoded:
        """Encode one conversation; raise :class:`RecordProblem` if it cannot be used."""
        result = self.encode_batch([messages])[0]
        if isinstance(result, RecordProblem):
            raise result
        return result

    def encode_batch(self, batch: Sequence[Messages]) -> list[Encoded | RecordProblem]:
        """Encode many conversations (plain ones in one tokenizer call); problems are returned."""
        out: list[Encoded | RecordProblem | None] = [None] * len(batch)
        plain: list[int] = []
        for k, messages in enumerate(batch):
            problem = self._unsupported(messages)
            if problem is not None:
                out[k] = problem
            elif self.has_special_text(messages) and self.special_tokens_in_content != "keep":
                out[k] = self._encode_one(messages, split=True)
            elif getattr(messages, "tools", None):
                out[k] = self._encode_one(messages, split=False)
            else:
                plain.append(k)
        if plain:
            try:
                raw = self._encode_raw([batch[k] for k in plain])
            except RecordProblem:  # one bad conversation fails the batch: encode one by one
                raw = None
            if raw is None:
                for k in plain:
                    out[k] = self._encode_one(batch[k], split=False)
            else:
                for k, (ids, mask) in zip(plain, raw, strict=True):
                    out[k] = self._finish(ids, mask)
        return out  # type: ignore[return-value]

    # -- internals ----------------------------------------------------------------------
    def _unsupported(self, messages: Messages) -> RecordProblem | None:
        if self.loss_on == "all" and _untrained(messages):
            k = min(_untrained(messages))
            return RecordProblem(
                "weight_unsupported",
                f"message {k} (assistant) has weight 0, but loss_on='all' trains every token; "
                "use loss_on='assistant' to honour the weights, or drop them",
            )
        if self.special_tokens_in_content == "error" and self.has_special_text(messages):
            k, found = next((k, match.group(0)) for k, m in enumerate(messages)
                            if isinstance(m.get("content"), str)
                            and (match := self._special_re.search(m["content"])))
            return RecordProblem(
                "special_token_in_content",
                f"message {k} ({messages[k]['role']}) content contains the control token text "
                f"{found!r}; use special_tokens_in_content='split' to tokenize it as plain text",
            )
        if not self.renders_tool_calls:
            for k, m in enumerate(messages):
                if m.get("tool_calls"):
                    return RecordProblem(
                        "tools_unsupported",
                        f"message {k} (assistant) has tool_calls, but the tokenizer's chat template "
                        "never reads tool_calls, so they would be dropped and an empty turn trained; "
                        "use a chat template that renders tool calls",
                    )
        if getattr(messages, "tools", None) and not self.renders_tools:
            return RecordProblem(
                "tools_unsupported",
                "the record has a 'tools' list, but the tokenizer's chat template never reads "
                "'tools'; use a chat template that renders tools, or drop the list",
            )
        return None

    def _encode_one(self, messages: Messages, split: bool) -> Encoded | RecordProblem:
        try:
            ids, mask = self._encode_split(messages) if split else self._encode_raw([messages])[0]
        except RecordProblem as exc:
            return exc
        return self._finish(ids, mask)

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

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Call the template / tokenizer; errors caused by the record become ``template_error``."""
        try:
            return fn(*args, **kwargs)
        except _RECORD_ERRORS as exc:
            raise RecordProblem("template_error", f"{type(exc).__name__}: {exc}") from exc

    def _template_call(self, batch: Sequence[Messages], **kwargs: Any) -> Any:
        tools = getattr(batch[0], "tools", None) if len(batch) == 1 else None
        return self._call(self.tokenizer.apply_chat_template, [list(m) for m in batch],
                          tools=tools, **kwargs)

    def _encode_raw(self, batch: Sequence[Messages]) -> list[Encoded]:
        if self.loss_on == "all":
            out = self._template_call(batch, tokenize=True, return_dict=True)
            return [
                (np.asarray(ids, dtype=np.int32), np.ones(len(ids), dtype=np.uint8))
                for ids in out["input_ids"]
            ]
        if self.use_tags:
            return self._encode_tags(batch)
        return self._encode_prefix(batch)

    def _tagged_batch(self, batch: Sequence[Messages]) -> tuple[list[Any], list[np.ndarray]]:
        """Token ids and generation-tag masks of a batch, the same as ``apply_chat_template(...,
        return_assistant_tokens_mask=True)`` returns, for less CPU: the template renders the
        generation spans, one batch encode tokenizes, and each span becomes a token slice
        (``char_to_token`` of its ends) instead of a per-token loop."""
        render = _jinja_renderer()
        if render is None or not hasattr(self.tokenizer, "get_chat_template"):
            out = self._template_call(batch, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
            return out["input_ids"], [np.asarray(m, dtype=np.uint8) for m in out["assistant_masks"]]
        tools = getattr(batch[0], "tools", None) if len(batch) == 1 else None
        template = self.tokenizer.get_chat_template(None, tools)
        # as apply_chat_template: message keys whose value is None are dropped
        plain = [[m if None not in m.values() else {k: v for k, v in m.items() if v is not None}
                  for m in messages] for messages in batch]
        rendered, spans = self._call(render, conversations=plain, tools=tools,
                                     chat_template=template, return_assistant_tokens_mask=True,
                                     **self.tokenizer.special_tokens_map)
        out = self._call(self.tokenizer, rendered, add_special_tokens=False)
        masks = []
        for k, ids in enumerate(out["input_ids"]):
            masks.append(_slice_mask(out.encodings[k], len(ids), spans[k]))
        return out["input_ids"], masks

    def _encode_tags(self, batch: Sequence[Messages]) -> list[Encoded]:
        all_ids, all_masks = self._tagged_batch(batch)
        result = []
        for messages, ids, mask_arr in zip(batch, all_ids, all_masks, strict=True):
            ids_arr = np.asarray(ids, dtype=np.int32)
            skip = _untrained_turns(messages)
            if self.loss_on == "last_assistant_turn" or skip:
                n_turns = sum(m["role"] == "assistant" for m in messages)
                starts, ends = _runs(mask_arr)
                if len(starts) != n_turns:  # turns touch: locate them by prefixes instead
                    ids_arr, mask_arr = self._encode_prefix([messages])[0]
                else:
                    keep = [n_turns - 1] if self.loss_on == "last_assistant_turn" else \
                        range(n_turns)
                    mask_arr = np.zeros_like(mask_arr)
                    for turn in keep:
                        if turn not in skip:
                            mask_arr[starts[turn] : ends[turn]] = 1
            result.append((ids_arr, mask_arr))
        return result

    def _render(self, messages: Messages, add_generation_prompt: bool) -> str:
        return self._call(self.tokenizer.apply_chat_template, list(messages), tokenize=False,
                          add_generation_prompt=add_generation_prompt,
                          tools=getattr(messages, "tools", None))

    def _assistant_spans(self, messages: Messages, full: str) -> list[tuple[int, int]]:
        """Character spans of the assistant turns in ``full``, found by rendering prefixes."""
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = self._render(_prefix(messages, i), True) if i else self._render_empty_prompt(messages)
            turn = self._render(_prefix(messages, i + 1), False)
            if not turn.startswith(prompt) or not full.startswith(turn):
                raise RecordProblem(
                    "template_error",
                    f"the chat template does not render message {i}'s prefix as a prefix of the "
                    "conversation, so assistant tokens cannot be located; add {% generation %} "
                    "tags to the template",
                )
            spans.append((i, (len(prompt), len(turn))))
        if self.loss_on == "last_assistant_turn":
            spans = spans[-1:]
        untrained = _untrained(messages)  # "weight": 0 turns are rendered, not trained
        return [span for i, span in spans if i not in untrained]

    def _render_empty_prompt(self, messages: Messages) -> str:
        try:
            return self._render(_prefix(messages, 0), True)
        except RecordProblem:  # templates may refuse an empty conversation
            return ""

    def _encode_prefix(self, batch: Sequence[Messages]) -> list[Encoded]:
        fulls = [self._render(messages, False) for messages in batch]
        spans = [self._assistant_spans(m, full) for m, full in zip(batch, fulls, strict=True)]
        enc = self._call(self.tokenizer, fulls, add_special_tokens=False, return_offsets_mapping=True)
        return [
            (np.asarray(ids, dtype=np.int32), _span_mask(np.asarray(offsets, dtype=np.int64).reshape(-1, 2), s))
            for ids, offsets, s in zip(enc["input_ids"], enc["offset_mapping"], spans, strict=True)
        ]

    # -- "split": control-token text in content becomes plain text -----------------------
    def _encode_split(self, messages: Messages) -> Encoded:
        """Render with markers around content's control-token text, then tokenize it as text.

        The rest of the conversation is tokenized exactly as usual: the tokenizer splits the
        text at special tokens before anything else, so replacing one such token's id by the
        plain-text ids of its characters leaves every other token unchanged.
        """
        marked = self._mark(messages)
        if self.loss_on == "all":
            rendered, spans = self._render(marked, False), None
        elif self.use_tags and self.loss_on == "assistant":
            from transformers.utils.chat_template_utils import render_jinja_template

            texts, indices = self._call(
                render_jinja_template, [list(marked)], tools=getattr(marked, "tools", None),
                chat_template=self.template, return_assistant_tokens_mask=True,
                **self.tokenizer.special_tokens_map,
            )
            rendered, spans = texts[0], [tuple(s) for s in indices[0]]
            if _untrained(marked):  # which span is which turn: by prefixes, as below
                spans = self._assistant_spans(marked, rendered)
        else:  # prefix spans; the markers are plain characters to the template
            rendered = self._render(marked, False)
            spans = self._assistant_spans(marked, rendered)
        text, keep_pos, runs = _strip_marks(rendered)
        enc = self._call(self.tokenizer, text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        offsets = [tuple(o) for o in enc["offset_mapping"]]
        for a, b in reversed(runs):  # splice from the end so earlier positions stay valid
            try:
                j = offsets.index((a, b))
            except ValueError:
                raise RecordProblem(
                    "template_error",
                    f"control-token text at characters {a}:{b} of the rendered conversation is not "
                    "one token; use special_tokens_in_content='keep' or 'error' for this template",
                ) from None
            plain_ids, plain_offsets = self._plain_text_ids(text[a:b])
            ids[j : j + 1] = plain_ids
            offsets[j : j + 1] = [(a + s, a + e) for s, e in plain_offsets]
        ids_arr = np.asarray(ids, dtype=np.int32)
        if spans is None:
            return ids_arr, np.ones(len(ids_arr), dtype=np.uint8)
        mapped = [(int(keep_pos[s]), int(keep_pos[e])) for s, e in spans]
        return ids_arr, _span_mask(np.asarray(offsets, dtype=np.int64).reshape(-1, 2), mapped)

    def _mark(self, messages: Messages) -> Messages:
        def wrap(match: re.Match[str]) -> str:
            return _MARK_START + match.group(0) + _MARK_END

        out = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, str):
                if _MARK_START in content or _MARK_END in content:
                    raise RecordProblem("invalid_field", "message content contains the private-use "
                                        "characters U+E000/U+E001, reserved for marking control-token text")
                m = {**m, "content": self._special_re.sub(wrap, content)}
            out.append(m)
        return Conversation(tuple(out), getattr(messages, "tools", None), _untrained(messages))

    def _plain_text_ids(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of ``text`` with special tokens not recognised (after a newline, so a
        SentencePiece tokenizer adds no word-start marker), offsets relative to ``text``."""
        tok = self.tokenizer
        nl = tok("\n", add_special_tokens=False)["input_ids"]
        enc = self._call(tok, "\n" + text, add_special_tokens=False, split_special_tokens=True,
                         return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
        if ids[: len(nl)] == nl:
            ids, offsets = ids[len(nl):], offsets[len(nl):]
        return ids, [(max(s - 1, 0), e - 1) for s, e in offsets]


def _prefix(messages: Messages, n: int) -> Messages:
    return Conversation(tuple(messages[:n]), getattr(messages, "tools", None),
                        frozenset(k for k in _untrained(messages) if k < n))


def _untrained(messages: Messages) -> frozenset[int]:
    """Message indices of the ``"weight": 0`` assistant turns (none for plain message lists)."""
    return getattr(messages, "untrained", frozenset())


def _untrained_turns(messages: Messages) -> set[int]:
    """The same turns, numbered among the assistant messages (0 = the first assistant turn)."""
    untrained = _untrained(messages)
    if not untrained:
        return set()
    ordinals = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    return {n for n, k in enumerate(ordinals) if k in untrained}


@functools.cache
def _jinja_renderer() -> Any:
    """transformers' batch renderer that also returns the generation spans (what
    ``apply_chat_template`` calls), or None when this transformers has no such function."""
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:  # pragma: no cover - then apply_chat_template is called instead
        return None
    return render_jinja_template


def _slice_mask(encoding: Any, n: int, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """1 for every token overlapping a character span, from the span ends' tokens.

    The tokens overlapping ``[a, b)`` run from the first token holding character ``a`` to the
    last token starting before ``b`` (several tokens can share one character's offsets when a
    multi-byte character is split), so a slice marks them (tokens are taken to cover at least
    one character, as tokenizers give for text). An end that no token holds
    (whitespace a tokenizer drops, or a span at the very end) falls back to the offsets.
    """
    mask = np.zeros(n, dtype=np.uint8)
    for a, b in spans:
        first = encoding.char_to_token(a)
        if b <= a:  # an empty span marks only the tokens that straddle its position
            if first is None or encoding.token_to_chars(first)[0] >= a:
                continue
            last = first
        else:
            last = encoding.char_to_token(b - 1)
            if first is None or last is None:
                return _span_mask(np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2), spans)
        while last + 1 < n and encoding.token_to_chars(last + 1)[0] < b:
            last += 1
        mask[first : last + 1] = 1
    return mask


def _span_mask(offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """1 for every token whose character range overlaps one of ``spans``."""
    mask = np.zeros(len(offsets), dtype=bool)
    for a, b in spans:
        mask |= (offsets[:, 0] < b) & (offsets[:, 1] > a)
    return mask.astype(np.uint8)


def _strip_marks(marked: str) -> tuple[str, np.ndarray, list[tuple[int, int]]]:
    """Remove the markers: (text, position in text of every marked position (n + 1 entries),
    character runs in text that were between a start and an end marker)."""
    is_mark = np.frombuffer(marked.encode("utf-32-le"), dtype=np.uint32)
    is_mark = (is_mark == ord(_MARK_START)) | (is_mark == ord(_MARK_END))
    keep_pos = np.concatenate(([0], np.cumsum(~is_mark))).astype(np.int64)
    text = marked.replace(_MARK_START, "").replace(_MARK_END, "")
    runs, pos = [], 0
    while (a := marked.find(_MARK_START, pos)) >= 0:
        b = marked.find(_MARK_END, a)
        if b < 0:
            raise RecordProblem("template_error", "the chat template cut control-token text in content apart")
        runs.append((int(keep_pos[a + 1]), int(keep_pos[b])))
        pos = b + 1
    return text, keep_pos, runs


def _runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and end (exclusive) positions of the runs of ones in a 0/1 array."""
    padded = np.concatenate(([0], mask.astype(np.int8), [0]))
    diff = np.diff(padded)
    return np.flatnonzero(diff == 1), np.flatnonzero(diff == -1)
