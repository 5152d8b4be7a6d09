"""A training run is never overwritten: a directory that holds one needs --resume or --overwrite.

A run leaves ``metrics.jsonl``, ``summary.json`` and ``checkpoints/step_*``. Training into such a
directory without ``--resume`` would silently replace them. `claim_output_dir` refuses that,
naming both choices; with ``overwrite`` it removes the old run's files first, so a later
``--resume`` can never pick up a checkpoint of the replaced run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

RUN_FILES = ("metrics.jsonl", "summary.json", "metrics.png", "wandb_run_id")
CHECKPOINTS = "checkpoints"


class OutputDirHoldsRun(RuntimeError):
    """The output directory holds a run and neither --resume nor --overwrite was given."""


def run_contents(directory: str | Path) -> list[str]:
    """What of a run ``directory`` holds (empty: nothing a new run would replace)."""
    directory = Path(directory)
    found = [name for name in RUN_FILES[:2] if (directory / name).is_file()]
    root = directory / CHECKPOINTS
    if root.is_dir() and any(root.glob("step_*")):
        found.append(f"{CHECKPOINTS}/")
    return found


def check_output_path(directory: str | Path) -> None:
    """The output path is a directory or does not exist yet (not a file)."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise OutputDirHoldsRun(f"output directory {directory} is a file, not a directory; "
                                "pick another --output-dir")


def claim_output_dir(directory: str | Path, *, resume: bool, overwrite: bool) -> list[str]:
    """Refuse to replace a run unless told to; return notes on what was removed."""
    if resume and overwrite:
        raise OutputDirHoldsRun("--resume and --overwrite exclude each other: --resume "
                                "continues the run, --overwrite replaces it")
    check_output_path(directory)
    found = run_contents(directory)
    if resume or not found:
        return []
    if not overwrite:
        raise OutputDirHoldsRun(
            f"output directory {directory} holds a run ({', '.join(found)}): pass --resume to "
            "continue it, or --overwrite to delete it and start again (or pick another "
            "--output-dir)")
    directory = Path(directory)
    for name in RUN_FILES:
        (directory / name).unlink(missing_ok=True)
    shutil.rmtree(directory / CHECKPOINTS, ignore_errors=True)
    return [f"--overwrite: removed the previous run in {directory} ({', '.join(found)})"]


__all__ = ["OutputDirHoldsRun", "check_output_path", "claim_output_dir", "run_contents"]
