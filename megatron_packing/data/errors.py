"""Errors and option checks for the SFT data pipeline.

Every bad record has a short stable reason key. The error message names the source, the
1-based line (or row), the reason and what a valid record looks like, so the user can fix it
without reading this code.
"""

from __future__ import annotations

LOSS_ON_CHOICES = ("assistant", "all", "last_assistant_turn")
ON_BAD_RECORD_CHOICES = ("error", "skip")
SPECIAL_TOKENS_IN_CONTENT_CHOICES = ("split", "keep", "error")

VALID_RECORD_HINT = (
    'a valid record is {"messages": [{"role": "user", "content": "..."}, '
    '{"role": "assistant", "content": "..."}]} with roles system/user/assistant/tool '
    '(assistant messages may carry OpenAI tool_calls), '
    'or {"instruction": "...", "input": "... (optional)", "output": "..."}, '
    'or {"prompt": "...", "response": "..."}'
)

REASONS: dict[str, str] = {
    "malformed_json": "the line is not valid JSON",
    "not_an_object": "the record is not a JSON object",
    "missing_field": "the record has none of the known field sets",
    "invalid_field": "a field has the wrong type",
    "empty_conversation": "the conversation has no messages",
    "non_string_content": "a message content (or instruction/output/prompt/response) is not a string",
    "unknown_role": "a message has a role other than system/user/assistant/tool",
    "no_assistant_turn": "the conversation has no assistant message to train on",
    "empty_assistant_turn": "an assistant message (or output/response) with no content and no tool calls",
    "tools_unsupported": "the record has tool calls or tools, but the chat template does not render them",
    "special_token_in_content": "message content contains a control token's text "
    "(with special_tokens_in_content='error')",
    "too_long": "the example is longer than max_length and truncation is off",
    "no_loss_tokens": "the example has no next-token target (one token, weight-0 or masked turns "
    "only, or nothing left after truncation)",
    "template_error": "the chat template refused the conversation",
    "weight_unsupported": "an assistant message has weight 0 but loss_on='all' trains every token",
}
"""Reason key -> one-line meaning. Keys are stable: ``ds.skipped`` counts by them."""


class BadRecordError(ValueError):
    """A record that cannot become a training example.

    Attributes:
        source: file path or dataset description.
        line: 1-based line (JSONL), element (JSON list) or row (dataset) number.
        reason: a key of :data:`REASONS`.
        detail: what exactly is wrong with this record.
    """

    def __init__(self, source: str, line: int, reason: str, detail: str) -> None:
        self.source = source
        self.line = line
        self.reason = reason
        self.detail = detail
        super().__init__(
            f"{source}:{line}: bad record ({reason}): {detail}. {VALID_RECORD_HINT}. "
            "Fix the record, or pass on_bad_record='skip' to skip and count such records."
        )

    def __reduce__(self) -> tuple[type[BadRecordError], tuple[str, int, str, str]]:
        # keep picklable across worker processes
        return (BadRecordError, (self.source, self.line, self.reason, self.detail))


class RecordProblem(Exception):
    """Raised inside parsing/tokenizing; the caller adds source and line."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REASONS, reason
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``choices``, else raise a ValueError listing them."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {', '.join(map(repr, choices))}")
    return value
