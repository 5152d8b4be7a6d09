"""The token-budget control file: what an operator writes to change a running job's budget.

Kept apart from the collective that agrees on a change (`megatron_packing.padded.sync`) so that
``megatron-packing budget`` writes it without importing torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from megatron_packing.common.validation import require_int, require_positive_int

NO_VALUE = -1

@dataclass(frozen=True)
class BudgetRequest:
    """A wish to change the budget; ``version`` orders competing requests (newest wins)."""

    max_tokens: int
    version: int
    from_step: int = NO_VALUE


EXAMPLE_REQUEST = '{"max_tokens_per_microbatch": 16384, "from_step": 1200} (from_step optional)'
BUDGET_FILE = "token_budget.json"
"""The control file's name in a run directory (``megatron-packing budget --run-dir``)."""


def write_budget_file(path: str | Path, max_tokens: int, from_step: int | None = None) -> Path:
    """Write a budget request to ``path`` atomically (a temporary file, then one rename)."""
    request: dict[str, int] = {
        "max_tokens_per_microbatch": require_positive_int("max_tokens_per_microbatch", max_tokens)}
    if from_step is not None:
        request["from_step"] = require_int("from_step", from_step, minimum=0)
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(request) + "\n")
    os.replace(partial, path)
    return path


def read_budget_file(path: str | Path) -> BudgetRequest | None:
    """Parse a control file: ``{"max_tokens_per_microbatch": N, "from_step": S}`` (JSON or YAML).

    ``from_step`` is optional. The request's version is the file's modification time in
    nanoseconds, on the same clock as `TokenBudgetController.request`. A missing or empty file
    reads as no request; one that is not such a mapping raises ``ValueError`` naming the file
    (`write_budget_file` replaces the file in one rename, so a reader never sees half of it).
    """
    path = Path(path)
    try:
        text = path.read_text()
        version = path.stat().st_mtime_ns
    except FileNotFoundError:
        return None
    if not text.strip():
        return None
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        import yaml

        try:
            document = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"{path}: not valid JSON or YAML ({str(err).splitlines()[0]}); "
                             f"expected {EXAMPLE_REQUEST}") from None
    if not isinstance(document, dict) or "max_tokens_per_microbatch" not in document:
        raise ValueError(f"{path}: expected a mapping like {EXAMPLE_REQUEST}, got "
                         f"{str(document)[:60]!r}")
    unknown = set(document) - {"max_tokens_per_microbatch", "from_step"}
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}; expected {EXAMPLE_REQUEST}")
    budget = require_positive_int(f"{path}: max_tokens_per_microbatch",
                                  document["max_tokens_per_microbatch"])
    from_step = require_int(f"{path}: from_step", document.get("from_step", NO_VALUE),
                            minimum=NO_VALUE)  # -1: from the first step no rank has planned
    return BudgetRequest(budget, version, from_step)
