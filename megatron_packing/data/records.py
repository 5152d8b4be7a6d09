"""Read chat and instruction records from JSONL/JSON files and datasets, and validate them.

A record becomes a :class:`Conversation`: a sequence of ``{"role", "content"}`` messages, plus
the record's ``tools`` list if it has one. Accepted shapes, in order of precedence when several are
present:

* ``{"messages": [{"role": ..., "content": ...}, ...], "tools": [...] (optional)}`` (roles
  system/user/assistant/tool). OpenAI / Hugging Face tool calls are accepted: an assistant
  message may carry ``tool_calls`` (then its ``content`` may be null or ""), a ``tool`` message
  may carry ``tool_call_id`` and ``name``;
* ``{"instruction", "input" (optional), "output"}`` -> user = instruction (+ blank line + input),
  assistant = output; an optional string ``"system"`` becomes a system message;
* ``{"prompt", "response"}`` -> user = prompt, assistant = response (same ``"system"`` rule).

Only ``role``, ``content`` and those tool-call keys of a message reach the chat template. An
assistant message may carry OpenAI's fine-tuning ``weight``: 0 renders the turn but puts no loss
on it, 1 trains it, anything else is a bad record. A tool call's ``arguments`` must be an object
or a string holding a JSON object (a broken one would train the model to emit it). An
assistant turn with neither content nor tool calls is a bad record (``empty_assistant_turn``):
training on it would teach the model to answer with nothing. Blank JSONL lines are not records
and are ignored.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

from .errors import RecordProblem

VALID_ROLES = ("system", "user", "assistant", "tool")

Messages = Sequence[dict[str, Any]]
"""A conversation's messages: a :class:`Conversation` or a plain list of message dicts."""


@dataclass(frozen=True)
class Conversation(Sequence[dict[str, Any]]):
    """A validated record: its messages, and its ``tools`` list (None when it has none).

    Reads as the sequence of its messages (``len``, indexing, iteration), which is what the chat
    template renders; ``tools`` travels with them to the template's ``tools`` argument.
    """

    messages: tuple[dict[str, Any], ...]
    tools: list[dict[str, Any]] | None = None
    untrained: frozenset[int] = frozenset()
    """Indices of the assistant messages with ``"weight": 0``: rendered, never a loss target."""

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[dict[str, Any], ...]: ...
    def __getitem__(self, index: int | slice) -> dict[str, Any] | tuple[dict[str, Any], ...]:
        return self.messages[index]

    def __len__(self) -> int:
        return len(self.messages)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.messages)

    @property
    def has_tool_calls(self) -> bool:
        return any(m.get("tool_calls") for m in self.messages)


def _string_field(record: dict[str, Any], key: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise RecordProblem(
            "non_string_content", f"field {key!r} is {type(value).__name__}, expected a string"
        )
    return value


def _with_system(record: dict[str, Any], user: str, assistant: str) -> Conversation:
    if not assistant.strip():
        raise RecordProblem("empty_assistant_turn", "the output/response is empty; an empty answer "
                            "would be trained")
    messages = []
    if record.get("system") is not None:
        messages.append({"role": "system", "content": _string_field(record, "system")})
    messages.append({"role": "user", "content": user})
    messages.append({"role": "assistant", "content": assistant})
    return Conversation(tuple(messages))


def _check_arguments(where: str, name: str, arguments: Any) -> None:
    """A tool call's ``arguments``: an object, or a string that holds one JSON object."""
    if isinstance(arguments, dict):
        return
    if not isinstance(arguments, str):
        raise RecordProblem("invalid_field", f"{where} function {name!r}: arguments must be a "
                            "JSON string or an object")
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as exc:
        raise RecordProblem("invalid_field", f"{where} function {name!r}: arguments is not "
                            f"valid JSON ({exc.msg} at character {exc.pos}): {arguments[:60]!r}; "
                            "the model would be trained to emit a broken call") from None
    if not isinstance(parsed, dict):
        raise RecordProblem("invalid_field", f"{where} function {name!r}: arguments must hold a "
                            f"JSON object, got {type(parsed).__name__}")


def _check_weight(k: int, role: str, msg: dict[str, Any]) -> bool:
    """True when the message is trained: OpenAI's per-message ``weight`` (assistant only, 0 or 1)."""
    if "weight" not in msg:
        return True
    weight = msg["weight"]
    if role != "assistant":
        raise RecordProblem("invalid_field", f"message {k} ({role}) has a weight; only assistant "
                            "messages take one (0: no loss on the turn, 1: trained)")
    if isinstance(weight, bool) or weight not in (0, 1):
        raise RecordProblem("invalid_field", f"message {k} (assistant) weight is {weight!r}; "
                            "expected 0 (no loss on this turn) or 1 (trained)")
    return weight == 1


def _check_tool_calls(k: int, calls: Any) -> list[dict[str, Any]]:
    """Validate an assistant message's OpenAI-style ``tool_calls`` list."""
    where = f"message {k} (assistant) tool_calls"
    if not isinstance(calls, list) or not calls:
        raise RecordProblem("invalid_field", f"{where} is {calls!r}; expected a non-empty list of "
                            '{"type": "function", "function": {"name": ..., "arguments": ...}}')
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RecordProblem("invalid_field", f"{where}[{j}] has no function name; expected "
                                '{"type": "function", "function": {"name": "...", "arguments": ...}}')
        _check_arguments(f"{where}[{j}]", fn["name"], fn.get("arguments"))
        if call.get("type", "function") != "function":
            raise RecordProblem("invalid_field", f"{where}[{j}] has type {call['type']!r}; only "
                                "'function' tool calls are supported")
    return calls


def _check_message(k: int, msg: Any) -> dict[str, Any]:
    if not isinstance(msg, dict):
        raise RecordProblem("invalid_field", f"message {k} is {type(msg).__name__}, expected an object")
    if "role" not in msg:
        raise RecordProblem("missing_field", f"message {k} lacks role")
    role = msg["role"]
    if role not in VALID_ROLES:
        raise RecordProblem(
            "unknown_role", f"message {k} has role {role!r}; valid roles are {', '.join(VALID_ROLES)}"
        )
    calls = msg.get("tool_calls") if role == "assistant" else None
    if "content" not in msg and calls is None:
        raise RecordProblem("missing_field", f"message {k} lacks content")
    content = msg.get("content")
    if not isinstance(content, str) and not (content is None and calls is not None):
        raise RecordProblem(
            "non_string_content",
            f"message {k} ({role}) content is {type(content).__name__}, expected a string"
            + (" (null content needs tool_calls)" if role == "assistant" else ""),
        )
    out: dict[str, Any] = {"role": role, "content": content}
    if calls is not None:
        out["tool_calls"] = _check_tool_calls(k, calls)
    elif role == "assistant" and isinstance(content, str) and not content.strip():
        raise RecordProblem(
            "empty_assistant_turn",
            f"message {k} (assistant) has empty content and no tool_calls; an empty turn would "
            "be trained as the answer",
        )
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if msg.get(key) is not None:
                if not isinstance(msg[key], str):
                    raise RecordProblem("invalid_field", f"message {k} (tool) {key} must be a string")
                out[key] = msg[key]
    return out


def _check_tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise RecordProblem("invalid_field", "'tools' must be a list of tool (JSON schema) objects")
    return raw or None


def _check_messages(raw: Any, tools: Any = None) -> Conversation:
    if not isinstance(raw, list):
        raise RecordProblem("invalid_field", f"'messages' is {type(raw).__name__}, expected a list")
    if not raw:
        raise RecordProblem("empty_conversation", "'messages' is an empty list")
    checked = tuple(_check_message(k, msg) for k, msg in enumerate(raw))
    untrained = frozenset(k for k, msg in enumerate(raw) if not _check_weight(k, msg["role"], msg))
    messages = Conversation(checked, _check_tools(tools), untrained)
    if not any(m["role"] == "assistant" for m in messages):
        raise RecordProblem("no_assistant_turn", "no message has role 'assistant'")
    return messages


def record_to_messages(record: Any) -> Conversation:
    """Validate one record and return its messages; raise :class:`RecordProblem` if bad."""
    if not isinstance(record, dict):
        raise RecordProblem("not_an_object", f"got {type(record).__name__}, expected an object")
    if "messages" in record:
        return _check_messages(record["messages"], record.get("tools"))
    if "instruction" in record or "output" in record:
        if "instruction" not in record or "output" not in record:
            have = "instruction" if "instruction" in record else "output"
            need = "output" if have == "instruction" else "instruction"
            raise RecordProblem("missing_field", f"has {have!r} but no {need!r}")
        user = _string_field(record, "instruction")
        output = _string_field(record, "output")
        if record.get("input") is not None:
            extra = _string_field(record, "input")
            if extra:
                user = f"{user}\n\n{extra}"
        return _with_system(record, user, output)
    if "prompt" in record or "response" in record:
        if "prompt" not in record or "response" not in record:
            have = "prompt" if "prompt" in record else "response"
            need = "response" if have == "prompt" else "prompt"
            raise RecordProblem("missing_field", f"has {have!r} but no {need!r}")
        return _with_system(
            record, _string_field(record, "prompt"), _string_field(record, "response")
        )
    keys = ", ".join(sorted(map(str, record))) or "no keys"
    raise RecordProblem("missing_field", f"record has {keys}; expected messages, instruction/output or prompt/response")


def parse_json_line(text: str | bytes) -> Any:
    """Parse one JSONL line; raise :class:`RecordProblem` with the decoder's message if bad."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RecordProblem("malformed_json", str(exc)) from None


RawItem = tuple[int, Any]
"""(1-based line/element/row number, raw text (JSONL) or already-parsed record)."""


def count_jsonl_lines(path: Path) -> int:
    """Number of lines in a file, counted fast on bytes (for the progress bar)."""
    n, last = 0, b"\n"
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def iter_jsonl(path: Path) -> Iterator[RawItem]:
    """Yield (line number, raw line bytes) for the non-blank lines of a JSONL file."""
    with path.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                yield lineno, line


def read_json_list(path: Path, source: str) -> list[RawItem]:
    """Parse a JSON file holding a list of records; return (line of element, record) pairs.

    A JSON file that does not parse cannot be resynchronised record by record, so it raises
    :class:`~megatron_packing.data.errors.BadRecordError` in every ``on_bad_record`` mode.
    """
    from .errors import BadRecordError

    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    if pos >= len(text) or text[pos] != "[":
        try:
            json.loads(text)
        except json.JSONDecodeError as exc:
            raise BadRecordError(source, exc.lineno, "malformed_json", str(exc)) from None
        raise BadRecordError(
            source, 1, "invalid_field", "a .json file must hold a list of records (use .jsonl for one record per line)"
        )
    pos = _skip_ws(text, pos + 1)
    items: list[RawItem] = []
    if pos < len(text) and text[pos] == "]":
        return items
    line = text.count("\n", 0, pos) + 1
    while True:
        try:
            record, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            raise BadRecordError(
                source, exc.lineno, "malformed_json",
                f"{exc}; a broken .json file cannot be skipped record by record",
            ) from None
        items.append((line, record))
        line += text.count("\n", pos, end)
        nxt = _skip_ws(text, end)
        line += text.count("\n", end, nxt)
        if nxt < len(text) and text[nxt] == "]":
            if _skip_ws(text, nxt + 1) != len(text):
                raise BadRecordError(source, line, "malformed_json", "extra data after the closing ']'")
            return items
        if nxt >= len(text) or text[nxt] != ",":
            raise BadRecordError(source, line, "malformed_json", "expected ',' or ']' between records")
        pos = _skip_ws(text, nxt + 1)
        line += text.count("\n", nxt, pos)


def _skip_ws(text: str, pos: int) -> int:
    n = len(text)
    while pos < n and text[pos] in " \t\r\n":
        pos += 1
    return pos
