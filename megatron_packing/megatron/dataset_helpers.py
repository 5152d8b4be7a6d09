"""megatron-core's compiled dataset helpers: imported, or built once, before any collective.

At start-up Megatron's training package (Megatron-LM's ``initialize_megatron``, and
Megatron-Bridge) calls ``megatron.core.datasets.utils.compile_helpers`` on one rank, which runs
``make`` in the installed ``megatron/core/datasets`` folder, and then waits in a barrier. The
megatron-core wheels ship the compiled module (``helpers_cpp``) but no Makefile: there make exits
2, ``compile_helpers`` calls ``sys.exit(1)`` on that rank, and the other ranks wait in the
barrier until the collective timeout.

So every rank calls `ensure_dataset_helpers` before Megatron initialises, with no collective:
where the helpers import, nothing is built; where they do not, the rank builds them with
Megatron's Makefile under a file lock (one builder per folder, the others wait and then
import); where they can neither import nor build, every rank raises `DatasetHelpersUnavailable`
at once, naming the cause and the fix. `compile_helpers_if_missing` then stands in for Megatron's
compile step: make runs only where the helpers still do not import.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

HELPERS_MODULE = "megatron.core.datasets.helpers_cpp"
DATASETS_PACKAGE = "megatron.core.datasets"
BUILD_LOCK = ".megatron_packing_helpers.lock"
FIX = ("reinstall megatron-core from its wheel for this Python, which ships the helpers "
       "prebuilt (pip install --force-reinstall --no-deps 'megatron-core==<your version>'), or "
       "install make, a C++ compiler and pybind11 so that Megatron's Makefile can build them")


class DatasetHelpersUnavailable(RuntimeError):
    """megatron-core's dataset helpers neither import nor build on this machine."""


def import_error() -> str | None:
    """Why the compiled helpers do not import, or None when they do."""
    importlib.invalidate_caches()  # a build by another process made a new file
    try:
        importlib.import_module(HELPERS_MODULE)
    except ImportError as error:
        return f"{type(error).__name__}: {error}"
    return None


def datasets_folder() -> Path:
    """The installed ``megatron/core/datasets`` folder, where Megatron runs make."""
    spec = importlib.util.find_spec(DATASETS_PACKAGE)
    if spec is None or spec.origin is None:
        raise DatasetHelpersUnavailable(f"{DATASETS_PACKAGE} is not installed: install "
                                        "megatron-core")
    return Path(spec.origin).parent


def build_blocker(folder: Path) -> str | None:
    """What stops make from building the helpers in ``folder``, or None when it can try."""
    if not (folder / "Makefile").is_file():
        return f"{folder} has no Makefile to build them with (megatron-core's wheel ships none)"
    if shutil.which("make") is None:
        return "`make` is not on PATH"
    if not os.access(folder, os.W_OK):
        return f"{folder} is not writable"
    return None


def build(folder: Path) -> str | None:
    """Run Megatron's Makefile in ``folder``; None on success, else make's last lines."""
    done = subprocess.run(["make", "-C", str(folder)], capture_output=True, text=True)
    if done.returncode == 0:
        return None
    tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
    return f"make -C {folder} exited {done.returncode}: " + " | ".join(tail)


def ensure_dataset_helpers(report: Callable[[str], None] | None = None) -> None:
    """Make ``helpers_cpp`` importable on this rank, or raise `DatasetHelpersUnavailable`.

    No collective is involved: every rank decides by itself, so a machine where the helpers
    cannot be had stops all ranks within seconds. A build takes the folder's file lock, so
    ranks sharing a folder build once.
    """
    from megatron_packing.data.build_lock import entry_lock, say

    error = import_error()
    if error is None:
        return
    folder = datasets_folder()
    blocker = build_blocker(folder)
    if blocker is None:
        with entry_lock(folder / BUILD_LOCK, what=f"the dataset helpers' build in {folder}",
                        report=report or say):
            error = import_error()
            if error is None:  # another rank built them while this one waited
                return
            (report or say)(f"building megatron-core's dataset helpers in {folder} with make")
            blocker = build(folder)
            if blocker is None:
                error = import_error()
                if error is None:
                    return
                blocker = f"make succeeded but they still do not import ({error})"
    raise DatasetHelpersUnavailable(
        f"megatron-core's compiled dataset helpers ({HELPERS_MODULE}) do not import ({error}) "
        f"and cannot be built here: {blocker}. Fix: {FIX}")


def compile_helpers_if_missing(original: Callable[[], None]) -> Callable[[], None]:
    """Megatron's ``compile_helpers`` (``original``), run only where the helpers do not import."""

    def compile_helpers() -> None:
        if import_error() is None:
            print(f"> megatron-core's dataset helpers import ({HELPERS_MODULE}); nothing to "
                  "compile", file=sys.stdout, flush=True)
            return
        original()

    compile_helpers.__wrapped__ = original  # type: ignore[attr-defined]
    return compile_helpers


def use_prebuilt_helpers() -> None:
    """Put `compile_helpers_if_missing` in place of megatron-core's ``compile_helpers``.

    Megatron's start-up imports the name from its module when it runs, so replacing the module
    attribute is enough. Idempotent.
    """
    from megatron.core.datasets import utils

    current = utils.compile_helpers
    if getattr(current, "__wrapped__", None) is None:
        utils.compile_helpers = compile_helpers_if_missing(current)


__all__ = ["DatasetHelpersUnavailable", "compile_helpers_if_missing", "ensure_dataset_helpers",
           "use_prebuilt_helpers"]
