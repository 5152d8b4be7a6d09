"""A quiet first run: known harmless third-party start-up warnings collapse into one line.

megatron-core, Megatron-LM's training package and torchdata warn, while they are imported and
set up, about things that do not matter to this project's runs: Transformer Engine or Apex
missing (the torch fallbacks are what the CPU demo and local layers use), torchdata calling
torch's deprecated ``set_vital``, megatron-core's deprecated default CUDA-graph scope. Two dozen
such lines came before a program's own first line.

`KNOWN_WARNINGS` declares each one: the package that emits it, how (a Python ``warnings``
warning or a ``logging`` record), a pattern its text matches, and why it is harmless here.
`begin` prints the program's first line, then collapses them: Python's hook for showing a
warning that passed the filters (``warnings.showwarning``) counts a known one instead of printing
it, and a ``logging.Filter`` on each emitting logger does the same for its records. Anything
else shows as before. `report` prints the one line that counts and names what was hidden.

A program's verbose flag, or a set ``PYTHONWARNINGS`` (or ``-W``), installs nothing: Python's own
filters decide, and every warning shows. The collapse belongs to a process, as the warnings
filters do; the processes a program spawns take it over through the environment (`inherit`).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TextIO

INHERIT_ENV = "MEGATRON_PACKING_QUIET_START"
"""Set, to the program's verbose flag, while a program collapses the known warnings, so that
the rank processes it spawns collapse them too (`inherit`)."""


@dataclass(frozen=True)
class KnownWarning:
    """One known harmless warning.

    ``source`` is where it comes from: for ``via="warnings"`` the emitting module's top-level
    package (a folder of that name in the warning's file path: the installed package or a
    checkout), for ``via="logging"`` the emitting logger's name. ``pattern`` is searched in the
    message text. ``label`` names it in the collapsed line.
    """

    label: str
    package: str
    via: Literal["warnings", "logging"]
    source: str
    pattern: str
    why: str

    def matches_warning(self, text: str, filename: str) -> bool:
        """Whether a ``warnings`` warning with this text, attributed to ``filename``, is this one."""
        return self.via == "warnings" and re.search(self.pattern, text) is not None and \
            _in_top_level_package(filename, self.source)

    def matches_record(self, record: logging.LogRecord) -> bool:
        """Whether a ``logging`` record is this one."""
        return self.via == "logging" and re.search(self.pattern, record.getMessage()) is not None


def _in_top_level_package(filename: str, package: str) -> bool:
    """Whether ``filename`` lies in a top-level package named ``package`` (a folder of that name
    whose parent is no package: ``site-packages/megatron``, a checkout's ``megatron``, never
    ``megatron_packing/megatron``)."""
    parts = Path(filename).parts
    return any(part == package and not Path(*parts[:i], "__init__.py").is_file()
               for i, part in enumerate(parts[:-1]) if i > 0)


KNOWN_WARNINGS: tuple[KnownWarning, ...] = (
    KnownWarning(
        label="Transformer Engine and Apex not installed",
        package="megatron-core (and Megatron-LM's training package)", via="warnings",
        source="megatron",
        pattern=r"^Transformer Engine and Apex are not installed\. Falling back to ",
        why="megatron-core falls back to torch's optimizers and multi-tensor kernels, which the "
            "CPU demo and the local layers (--transformer-impl local) run on by design; "
            "installing Transformer Engine removes it"),
    KnownWarning(
        label="Apex not installed",
        package="megatron-core", via="warnings", source="megatron",
        pattern=r"^Apex is not installed\. Falling back to Torch Norm",
        why="torch's LayerNorm stands in for Apex's fused one in the local layer specs, with "
            "the same result"),
    KnownWarning(
        label="torchdata's deprecated set_vital call",
        package="torchdata", via="warnings", source="torchdata",
        pattern=r"^'set_vital' is deprecated",
        why="StatefulDataLoader calls torch.set_vital (telemetry) each time a loader is "
            "built; torch ignores the call, and nothing here can change it"),
    KnownWarning(
        label="megatron-core's deprecated default CUDA-graph scope",
        package="megatron-core", via="warnings", source="megatron",
        pattern=r"^full scope is deprecated\. Use empty cuda_graph_(scope|modules) to capture "
                r"the whole layer",
        why="TransformerConfig's own default ('full') warns about itself; no CUDA graphs are "
            "used (the Megatron-LM entry point refuses them)"),
    KnownWarning(
        label="absl-py not installed",
        package="megatron-core 0.19", via="warnings", source="megatron",
        pattern=r"^absl\.logging is not installed\. Using logging\.getLogger",
        why="megatron-core's process-grid module logs through Python's logging instead of "
            "absl's; nothing is lost"),
    KnownWarning(
        label="Megatron's legacy tokenizer",
        package="megatron-core 0.16", via="logging",
        source="megatron.core.datasets.megatron_tokenizer",
        pattern=r"^You're using the legacy tokenizer system, which is deprecated",
        why="the packing loader tokenizes with data.tokenizer; Megatron's --tokenizer-type "
            "only sizes the vocabulary here (0.19 no longer logs it)"),
)


class QuietStart:
    """The collapse of `KNOWN_WARNINGS` in this process, and the count of what it hid."""

    def __init__(self, verbose_flag: str, known: tuple[KnownWarning, ...] = KNOWN_WARNINGS) -> None:
        self.verbose_flag = verbose_flag
        self.known = known
        self.hidden: Counter[str] = Counter()
        self.reported = False
        self._shown_before = warnings.showwarning
        self._filters: list[tuple[logging.Logger, logging.Filter]] = []

    def install(self) -> None:
        """Take over ``warnings.showwarning`` and filter each known logger's records."""
        self._shown_before = warnings.showwarning
        warnings.showwarning = self._show
        for entry in self.known:
            if entry.via == "logging":
                logger = logging.getLogger(entry.source)
                record_filter = _RecordFilter(self, entry)
                logger.addFilter(record_filter)
                self._filters.append((logger, record_filter))

    def uninstall(self) -> None:
        """Show every warning again, as before `install`."""
        if warnings.showwarning == self._show:
            warnings.showwarning = self._shown_before
        for logger, record_filter in self._filters:
            logger.removeFilter(record_filter)
        self._filters.clear()

    def _show(self, message: Warning | str, category: type[Warning], filename: str,
              lineno: int, file: TextIO | None = None, line: str | None = None) -> None:
        text = str(message)
        for entry in self.known:
            if entry.matches_warning(text, filename):
                self.hidden[entry.label] += 1
                return
        self._shown_before(message, category, filename, lineno, file, line)

    def summary(self) -> str | None:
        """The collapsed line, or None when nothing was hidden."""
        count = sum(self.hidden.values())
        if not count:
            return None
        names = ", ".join(label for label in dict.fromkeys(e.label for e in self.known)
                          if self.hidden[label])
        plural = "s" if count > 1 else ""
        return (f"(hid {count} known third-party start-up warning{plural}: {names}; "
                f"{self.verbose_flag} shows them)")


class _RecordFilter(logging.Filter):
    """Drops, and counts, one known entry's records on its logger."""

    def __init__(self, quiet: QuietStart, entry: KnownWarning) -> None:
        super().__init__()
        self.quiet, self.entry = quiet, entry

    def filter(self, record: logging.LogRecord) -> bool:
        if self.entry.matches_record(record):
            self.quiet.hidden[self.entry.label] += 1
            return False
        return True


_active: list[QuietStart] = []


def shows_everything(verbose: bool) -> bool:
    """Whether every warning shows: the verbose flag, or ``PYTHONWARNINGS`` / ``-W`` set."""
    return verbose or bool(sys.warnoptions)


def is_global_rank_zero() -> bool:
    """False only in a launched rank (``RANK`` set) other than 0."""
    return os.environ.get("RANK", "0") == "0"


def begin(first_line: str | None, *, verbose: bool, verbose_flag: str) -> QuietStart | None:
    """Print ``first_line`` (global rank 0 only), then collapse the known warnings in this
    process and in the processes it spawns, unless `shows_everything`; the collapse, or None."""
    if first_line is not None and is_global_rank_zero():
        print(first_line, flush=True)
    end()
    if shows_everything(verbose):
        return None
    os.environ[INHERIT_ENV] = verbose_flag
    return _start(verbose_flag)


def inherit() -> QuietStart | None:
    """In a process that a quiet program spawned: collapse the known warnings here too."""
    flag = os.environ.get(INHERIT_ENV)
    if not flag or shows_everything(False) or _active:
        return _active[0] if _active else None
    return _start(flag)


def _start(verbose_flag: str) -> QuietStart:
    quiet = QuietStart(verbose_flag)
    quiet.install()
    _active.append(quiet)
    return quiet


def report(prefix: str = "", *, show: bool | None = None) -> None:
    """Print the collapsed line once, after start-up, where ``show`` (default: on global rank
    0); later known warnings stay hidden."""
    if not _active or _active[0].reported:
        return
    quiet = _active[0]
    quiet.reported = True
    line = quiet.summary()
    if line is not None and (is_global_rank_zero() if show is None else show):
        print(f"{prefix}{line}", flush=True)


def end() -> None:
    """Undo `begin` / `inherit` in this process: every warning shows again."""
    while _active:
        _active.pop().uninstall()
    os.environ.pop(INHERIT_ENV, None)
