"""The packing layer must import without torch, megatron or transformers."""

from __future__ import annotations

import subprocess
import sys


def test_every_packing_module_imports_without_heavy_dependencies() -> None:
    code = (
        "import importlib, pkgutil, sys\n"
        "import megatron_packing.packing as p\n"
        "names = [m.name for m in pkgutil.walk_packages(p.__path__, 'megatron_packing.packing.')]\n"
        "assert {'megatron_packing.packing.factory', 'megatron_packing.packing.planner.sizer'} <= set(names), names\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "from megatron_packing import make_token_balanced_microbatches as f\n"
        "assert f is sys.modules['megatron_packing.packing.microbatch'].make_token_balanced_microbatches\n"
        "heavy = [m for m in ('torch', 'megatron.core', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
