"""Launch helpers of the Bridge host tests: torchrun over `run_bridge_host.py`, per-rank records.

``BRIDGE_SKIP`` says why the Bridge tier cannot run here (megatron-bridge is installed only in the
second stack's venv, Python 3.12: scripts/test_stack312.sh).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "megatron_lm"))
from megatron_lm_runs import descendants, read_records  # noqa: E402

HERE = Path(__file__).resolve().parent
PROJECT = HERE.parent.parent
RUN_HOST = HERE / "run_bridge_host.py"


def _missing() -> str | None:
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec(
            "megatron.core") is None:
        return "megatron-core is not installed"
    try:
        found = importlib.util.find_spec("megatron.bridge")
    except ModuleNotFoundError:
        found = None
    if found is None:
        return ("megatron-bridge is not installed (the Bridge tier runs on the second stack: "
                "scripts/test_stack312.sh)")
    return None


BRIDGE_SKIP = _missing()
requires_bridge = pytest.mark.skipif(BRIDGE_SKIP is not None, reason=BRIDGE_SKIP or "")


@dataclass
class Run:
    returncode: int
    output: str
    records: dict[int, list[dict]] = field(default_factory=dict)

    def steps(self, rank: int = 0) -> list[dict]:
        return self.records.get(rank, [])


_PORT = [31200 + (os.getpid() % 200) * 5]


def host_command(nproc: int, args: list[str]) -> list[str]:
    _PORT[0] += 1
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--master-port={_PORT[0]}", str(RUN_HOST), *args]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PROJECT), env.get("PYTHONPATH", "")])
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", WANDB_MODE="disabled",
               PYTHONUNBUFFERED="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    return env


def launch(nproc: int, args: list[str], log_dir: Path, *, timeout: float = 300) -> Run:
    proc = subprocess.run(host_command(nproc, [*args, "--step-log-dir", str(log_dir)]),
                          env=_env(), capture_output=True, text=True, timeout=timeout)
    return Run(proc.returncode, proc.stdout + proc.stderr, read_records(log_dir))


def launch_and_kill(nproc: int, args: list[str], log_dir: Path, *, kill_when,
                    timeout: float = 300) -> Run:
    """Start the host; once ``kill_when()``, SIGKILL torchrun and every rank (no clean-up)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out_path = log_dir / "output.txt"  # a file, not a pipe: a full pipe would stall the ranks
    with open(out_path, "w") as out:
        proc = subprocess.Popen(host_command(nproc, [*args, "--step-log-dir", str(log_dir)]),
                                env=_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        deadline = time.monotonic() + timeout
        try:
            while not kill_when():
                if proc.poll() is not None:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError("the run never reached the kill point")
                time.sleep(0.01)
        finally:  # torchrun and every rank, as a scheduler's job kill: nobody cleans up
            for pid in [proc.pid, *descendants(proc.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
    return Run(proc.returncode, out_path.read_text(), read_records(log_dir))


def tracker_says(save: Path, iteration: int):
    def reached() -> bool:
        tracker = save / "latest_checkpointed_iteration.txt"
        return tracker.exists() and tracker.read_text().strip() == str(iteration)

    return reached


PACKED_KEYS = {"align_packing_bins_to_dp": True, "packing_batch_size_allowed_variation": 0.2,
               "oversize_policy": "truncate", "seed": 1234}


def write_yaml(path: Path, data_dir: Path, **packing: object) -> Path:
    """A training YAML over a slice of the shipped demo chats and tokenizer."""
    keys = {**PACKED_KEYS, **packing}
    if keys.get("use_sequence_packing") is False:
        for key in ("align_packing_bins_to_dp", "packing_batch_size_allowed_variation",
                    "oversize_policy"):
            keys.pop(key, None)
    lines = ["packing:", *(f"  {key}: {json.dumps(value)}" for key, value in keys.items())]
    lines += ["data:", f"  paths: [{data_dir / 'train.jsonl'}]",
              f"  tokenizer: {PROJECT / 'examples' / 'tokenizer'}",
              f"  cache_dir: {data_dir / 'cache'}"]
    path.write_text("\n".join(lines) + "\n")
    return path


def trained_past(log_dir: Path, iteration: int):
    """Once rank 0 has logged a step after ``iteration``: the checkpoint at ``iteration`` is
    complete (Bridge names it in its tracker file before it writes its run_config.yaml)."""
    def reached() -> bool:
        path = log_dir / "steps_rank0.jsonl"
        return path.exists() and any(json.loads(line)["iteration"] > iteration
                                     for line in path.read_text().splitlines()
                                     if line.endswith("}"))

    return reached
