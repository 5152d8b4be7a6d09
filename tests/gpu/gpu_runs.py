"""What the GPU tier's tests share: the CUDA gate, the GPU launch of the Megatron-LM entry point,
and the demo data.

The launch helpers of the CPU tier (`tests/megatron_lm/megatron_lm_runs.py`: step records,
process trees, the training YAML, the resume comparison) are imported from their file and reused;
only the command differs. Here it is the entry point itself on one GPU,
``python -m torch.distributed.run --nproc-per-node=1 -m megatron_packing.megatron_lm``, with
megatron-core's own ``megatron.training`` (the 0.19 wheel), the library's GPT provider, no
Megatron-LM checkout, no CPU shims and none of the CPU tier's CPU-only flags.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

PROJECT = Path(__file__).resolve().parents[2]
CHATS = PROJECT / "examples" / "data" / "demo_chat.jsonl"
TOKENIZER = PROJECT / "examples" / "tokenizer"


def _load_runs() -> ModuleType:
    """`tests/megatron_lm/megatron_lm_runs.py`, once per process, under its own module name."""
    name = "megatron_lm_runs"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, PROJECT / "tests" / "megatron_lm" / "megatron_lm_runs.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


runs = _load_runs()

NO_CUDA = ("no CUDA device (torch.cuda.is_available() is False); the GPU tier runs on a GPU "
           "machine: bash benchmarks/gpu_device_run.sh WHEEL... (docs/gpu.md)")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
# Every test of the tier: marker gpu, slow (so -m fast leaves it out), skipped without CUDA.
TIER = [pytest.mark.gpu, pytest.mark.slow, requires_cuda]


def transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def wheel_training_missing() -> str | None:
    """Why the entry point cannot run from the installed megatron-core's own
    ``megatron.training`` with the modules its run needs, or None when it can."""
    try:
        dist = importlib.metadata.distribution("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return "megatron-core is not installed (carry its 0.19 wheel)"
    shipped = Path(str(dist.locate_file("megatron/training/training.py")))
    if not shipped.is_file():
        return (f"the installed megatron-core {dist.version} ships no megatron.training "
                "(0.19 and newer do): the GPU tier runs the wheel path, with no checkout")
    for module, why in (("psutil", "torch_dist's checkpoint writer"),
                        ("xxhash", "the length index"), ("torchdata", "the loader")):
        if importlib.util.find_spec(module) is None:
            return f"`{module}` is not importable ({why} needs it): carry its wheel"
    return None


requires_wheel_training = pytest.mark.skipif(
    torch.cuda.is_available() and wheel_training_missing() is not None,
    reason=wheel_training_missing() or "")

# A small GPT in bf16 on one GPU. The fusion flags name kernels that need Apex or Megatron's
# compiled extensions (neither is on a machine with the wheel alone); learned absolute positions
# make the restarting position ids count. Validation is off (--eval-iters 0).
GPU_MODEL_ARGS = [
    "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
    "--seq-length", "2048", "--max-position-embeddings", "2048", "--micro-batch-size", "1",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
    "--weight-decay", "0.01", "--bf16", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "2815", "--calculate-per-token-loss",
    "--position-embedding-type", "learned_absolute", "--attention-dropout", "0",
    "--hidden-dropout", "0", "--seed", "1234", "--log-interval", "1", "--eval-iters", "0",
    "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
    "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
    "--packing-model-provider", "project", "--distributed-timeout-minutes", "3",
]


def transformer_impl() -> list[str]:
    """Transformer Engine layers (THD rows) where TE imports, megatron-core's local layers
    (block-diagonal mask) otherwise."""
    return ["--transformer-impl", "transformer_engine" if transformer_engine() else "local"]


ENTRY = ["-m", "megatron_packing.megatron_lm"]


def entry_point_command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node=1", *ENTRY, *GPU_MODEL_ARGS, *transformer_impl(), *args]


def failing_make(folder: Path) -> tuple[dict[str, str], Path]:
    """A ``make`` first on ``PATH`` that records each call and always fails: the environment to
    launch with, and the file its calls land in (absent while make never ran)."""
    folder.mkdir(parents=True, exist_ok=True)
    calls = folder / "calls"
    make = folder / "make"
    make.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\nexit 2\n")
    make.chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"}, calls


def launch_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment with the project first on ``PYTHONPATH`` and no checkout."""
    env = {key: value for key, value in os.environ.items() if key != "MEGATRON_LM_PATH"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT), env.get("PYTHONPATH")) if p)
    env.update(CUDA_DEVICE_MAX_CONNECTIONS="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1",
               **extra)
    return env


def launch(args: list[str], log_dir: Path, *, env: dict[str, str], timeout: float = 180,
           kill_when: Callable[[Path], bool] | None = None) -> runs.Run:
    """Run the entry point on one GPU to its end; or, with ``kill_when``, SIGKILL torchrun and
    every process below it once ``kill_when(log_dir)`` holds (a scheduler's job kill)."""
    proc = subprocess.Popen(entry_point_command([*args, "--packing-log-dir", str(log_dir)]),
                            env=launch_env(env), cwd=PROJECT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output_of = runs.drain(proc)
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None:
            if kill_when is not None and kill_when(log_dir):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the launch ran past {timeout:.0f} s")
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            for pid in [proc.pid, *runs.descendants(proc.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        proc.wait()
    return runs.Run(proc.returncode, output_of(), log_dir, runs.read_records(log_dir))


def ended(run: runs.Run) -> str:
    """An assertion message for a launch: how it ended first, then its last output."""
    return f"the launch exited {run.returncode}; its last output:\n{run.output[-4000:]}"


def write_chats(folder: Path, train: int, valid: int = 16) -> Path:
    """The first ``train`` demo chats as train.jsonl and the next ``valid`` as valid.jsonl."""
    chats = CHATS.read_text().splitlines()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.jsonl").write_text("\n".join(chats[:train]) + "\n")
    (folder / "valid.jsonl").write_text("\n".join(chats[train:train + valid]) + "\n")
    return folder
