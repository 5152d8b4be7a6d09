"""Module paths the package no longer has, refused with the path that replaced them.

Nothing is served from an old path (there is no alias to drift): importing one fails at once,
as a `ModuleNotFoundError` that names the new module, so an upgrade's broken import says what
to write instead. The finder sits last on ``sys.meta_path``: it is asked only about modules
that no other finder has.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

MOVED_MODULES: dict[str, str] = {
    "megatron_packing.base_order": "megatron_packing.stream.base_order",
    "megatron_packing.fetch": "megatron_packing.stream.fetch",
    "megatron_packing.loader_state": "megatron_packing.loader.state",
    "megatron_packing.metrics": "megatron_packing.loader.metrics",
    "megatron_packing.plan_types": "megatron_packing.common.plan_types",
    "megatron_packing.simulation": "megatron_packing.reports.simulation",
    "megatron_packing.state_checks": "megatron_packing.stream.state_checks",
    "megatron_packing.step_stream": "megatron_packing.stream.step_stream",
    "megatron_packing.validation": "megatron_packing.common.validation",
    "megatron_packing.megatron.checkpoint": "megatron_packing.demo.checkpoint",
    "megatron_packing.megatron.demo_trainer": "megatron_packing.demo.trainer",
    "megatron_packing.megatron.launch": "megatron_packing.demo.launch",
    "megatron_packing.megatron.megatron_lm": "megatron_packing.megatron.step_accounting",
    "megatron_packing.megatron.model": "megatron_packing.demo.model",
    "megatron_packing.megatron.run_dir": "megatron_packing.demo.run_dir",
    "megatron_packing.megatron.run_lock": "megatron_packing.demo.run_lock",
    "megatron_packing.megatron.train_step": "megatron_packing.demo.train_step",
    "megatron_packing.megatron.trainer_config": "megatron_packing.config.training",
}
"""Old module path -> the module that holds its contents now."""


class MovedModuleFinder:
    """Refuses an import of a `MOVED_MODULES` path, naming its new module."""

    @staticmethod
    def find_spec(name: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        new = MOVED_MODULES.get(name)
        if new is None:
            return None
        raise ModuleNotFoundError(f"{name} has moved: import {new} instead (the package's "
                                  "modules by layer are listed in docs/DESIGN.md)", name=name)


def install() -> None:
    """Put the finder last on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
