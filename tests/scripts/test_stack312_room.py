"""The second stack's install script says when the disk lacks room, before pip starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _source_env312(tmp_path: Path, free_gb: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, MEGATRON_PACKING_VENV312=str(tmp_path / "venv312"),
               PYTHON312=sys.executable, MEGATRON_PACKING_STACK312_FREE_GB=free_gb)
    return subprocess.run(["bash", "-c", f'source "{ROOT}/scripts/_env312.sh"'], env=env,
                          capture_output=True, text=True, timeout=60)


def test_too_little_room_stops_before_pip_with_the_ways_out(tmp_path: Path) -> None:
    done = _source_env312(tmp_path, str(10**9))  # more than any disk has
    assert done.returncode == 1
    message = done.stderr.strip()
    assert len(message.splitlines()) == 1
    assert "needs about 1000000000 GB free" in message
    assert "MEGATRON_PACKING_VENV312" in message and "MEGATRON_PACKING_STACK312=0" in message
    assert "installing" not in done.stdout  # pip never started
    assert not (tmp_path / "venv312").exists()


def test_a_room_that_is_not_a_number_is_refused(tmp_path: Path) -> None:
    done = _source_env312(tmp_path, "8GB")
    assert done.returncode == 1
    assert "MEGATRON_PACKING_STACK312_FREE_GB must be a whole number of GB, got '8GB'" in done.stderr
    assert not (tmp_path / "venv312").exists()
