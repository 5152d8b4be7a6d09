"""The GPU smoke script, where there is no GPU: one clear line, exit 0, nothing run."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from megatron_lm_runs import PROJECT


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: run the script")
def test_the_gpu_smoke_script_exits_cleanly_without_a_gpu(tmp_path):
    done = subprocess.run([sys.executable, str(PROJECT / "benchmarks" / "gpu_smoke.py"),
                           "--keep", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == ("gpu_smoke: no CUDA device here; this smoke test needs one "
                                   "GPU. Nothing was run.")
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "work").exists()
