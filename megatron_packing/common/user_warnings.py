"""Warnings about a user's input or use, shown as one line that names the program.

Python prints a warning with the file and line that raised it and that line's source: right
for a programmer, noise for a user told that a key has no effect. `UserFacingWarning` marks the
project's own warnings of that kind (a key the mode does not read, a section a command ignores,
a state loaded while an iterator runs); `one_line_warnings` makes a program print each as
``<program>: warning: <message>``. Every other warning is shown as Python shows it.
"""

from __future__ import annotations

import warnings
from typing import Any


class UserFacingWarning(UserWarning):
    """A warning about what a user gave or did, for them to read (not a programming issue)."""


def one_line_warnings(program: str) -> None:
    """Show `UserFacingWarning`\\ s as one line naming ``program`` (for the rest of the process)."""
    shown_before = warnings.formatwarning

    def format_warning(message: Any, category: type[Warning], filename: str, lineno: int,
                       line: str | None = None) -> str:
        if issubclass(category, UserFacingWarning):
            return f"{program}: warning: {message}\n"
        return shown_before(message, category, filename, lineno, line)

    warnings.formatwarning = format_warning


__all__ = ["UserFacingWarning", "one_line_warnings"]
