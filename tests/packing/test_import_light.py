"""The packing layer must import without torch, megatron or transformers."""

from __future__ import annotations

import subprocess
import sys


def test_packing_imports_without_heavy_dependencies() -> None:
    code = (
        "import sys\n"
        "import megatron_packing.packing.factory, megatron_packing.packing.balance\n"
        "heavy = [m for m in ('torch', 'megatron.core', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
