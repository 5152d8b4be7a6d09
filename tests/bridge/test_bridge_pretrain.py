"""Megatron-Bridge's own ``pretrain()`` on CPU with gloo, through `bridge_shims`.

One launch (6 iterations at DP 2) serves the import check and the training check: the shims,
tried on Bridge's own loop. It runs ``run_bridge_cpu.py`` under ``torch.distributed.run`` with
no CUDA device visible. Bridge's checkpoints and their exact resume (RNG states included) are
tried through the host (test_bridge_host.py).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.bridge") is None:
    # Guarded: Bridge is never imported here at collection (its import needs the shims and ~15 s).
    pytest.importorskip("megatron.bridge", reason="Megatron-Bridge (megatron.bridge) is not installed")

pytestmark = [pytest.mark.slow, pytest.mark.bridge]

RUNNER = Path(__file__).resolve().parent / "run_bridge_cpu.py"
REPO = Path(__file__).resolve().parents[2]
DROPOUT = "0.1"  # so that resuming has RNG state to restore
LAUNCH_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(out: Path, *args: str) -> subprocess.CompletedProcess:
    """torchrun over the runner, its output in ``out/output.txt`` (a file, not a pipe: a process
    a rank leaves behind cannot hold the test up)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(_free_port()), str(RUNNER), "--out", str(out),
               "--dropout", DROPOUT, *args]
    log = out / "output.txt"
    with open(log, "w") as sink:
        launcher = subprocess.Popen(command, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT)
        try:
            launcher.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            launcher.terminate()  # torchrun stops its ranks on SIGTERM
            try:
                launcher.wait(timeout=30)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait()
            pytest.fail(f"the launch ran past {LAUNCH_TIMEOUT_S} s:\n{log.read_text()[-6000:]}")
    return subprocess.CompletedProcess(command, launcher.returncode, log.read_text(), "")


def _losses(out: Path, run: subprocess.CompletedProcess) -> dict[int, dict]:
    path = out / "losses.jsonl"
    assert run.returncode == 0 and path.exists(), run.stdout[-6000:]
    return {row["iteration"]: row for row in map(json.loads, path.read_text().splitlines())}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """6 iterations at DP 2."""
    out = tmp_path_factory.mktemp("uninterrupted")
    run = _launch(out, "--train-iters", "6")
    return out, _losses(out, run)


def test_bridge_imports_without_transformer_engine_or_nvrx(uninterrupted):
    out, _ = uninterrupted
    facts = json.loads((out / "imports.json").read_text())
    for package in ("transformer_engine", "nvidia_resiliency_ext"):
        assert facts[package] == {"find_spec_is_none": True, "in_sys_modules": False}, package
    assert facts["megatron_core_HAVE_TE"] is False


def test_bridge_pretrain_trains_the_tiny_gpt_at_dp2(uninterrupted):
    _, losses = uninterrupted
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    values = [losses[i]["loss"] for i in range(1, 7)]
    assert all(math.isfinite(v) for v in values), values
    assert not any(losses[i]["skipped"] for i in losses)
    assert values[-1] < values[0] - 0.2, values  # about ln(128) = 4.85 falling to 4.4
    assert all(later < earlier for earlier, later in itertools.pairwise(values)), values
