"""Read chat and instruction records from JSONL/JSON files and datasets, and validate them.

A record becomes a list of ``{"role", "content"}`` messages. Accepted shapes, in order of
precedence when several are present:

* ``{"messages": [{"role": ..., "content": ...}, ...]}`` (roles system/user/assistant/tool);
* ``{"instruction", "input" (optional), "output"}`` -> user = instruction (+ blank line + input),
  assistant = output; an optional string ``"system"`` becomes a system message;
* ``{"prompt", "response"}`` -> user = prompt, assistant = response (same ``"system"`` rule).

Only ``role`` and ``content`` of a message are passed to the chat template. Blank JSONL lines
are not records and are ignored.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import RecordProblem

VALID_ROLES = ("system", "user", "assistant", "tool")

Messages = list[dict[str, str]]


def _string_field(record: dict[str, Any], key: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise RecordProblem(
            "non_string_content", f"field {key!r} is {type(value).__name__}, expected a string"
        )
    return value


def _with_system(record: dict[str, Any], user: str, assistant: str) -> Messages:
    messages: Messages = []
    if record.get("system") is not None:
        messages.append({"role": "system", "content": _string_field(record, "system")})
    messages.append({"role": "user", "content": user})
    messages.append({"role": "assistant", "content": assistant})
    return messages


def _check_messages(raw: Any) -> Messages:
    if not isinstance(raw, list):
        raise RecordProblem("invalid_field", f"'messages' is {type(raw).__name__}, expected a list")
    if not raw:
        raise RecordProblem("empty_conversation", "'messages' is an empty list")
    messages: Messages = []
    for k, msg in enumerate(raw):
        if not isinstance(msg, dict):
            raise RecordProblem(
                "invalid_field", f"message {k} is {type(msg).__name__}, expected an object"
            )
        if "role" not in msg or "content" not in msg:
            missing = [key for key in ("role", "content") if key not in msg]
            raise RecordProblem("missing_field", f"message {k} lacks {', '.join(missing)}")
        role, content = msg["role"], msg["content"]
        if role not in VALID_ROLES:
            raise RecordProblem(
                "unknown_role",
                f"message {k} has role {role!r}; valid roles are {', '.join(VALID_ROLES)}",
            )
        if not isinstance(content, str):
            raise RecordProblem(
                "non_string_content",
                f"message {k} ({role}) content is {type(content).__name__}, expected a string",
            )
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise RecordProblem("no_assistant_turn", "no message has role 'assistant'")
    return messages


def record_to_messages(record: Any) -> Messages:
    """Validate one record and return its messages; raise :class:`RecordProblem` if bad."""
    if not isinstance(record, dict):
        raise RecordProblem("not_an_object", f"got {type(record).__name__}, expected an object")
    if "messages" in record:
        return _check_messages(record["messages"])
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
