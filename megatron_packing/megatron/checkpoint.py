"""Per-rank checkpoints: model, optimizer, LR schedule, the dataloader's state and the step.

Layout: ``<dir>/checkpoints/step_000020/rank0.pt`` ... and ``<dir>/checkpoints/latest`` naming
the newest complete step. ``latest`` is written last (after every rank saved), so a run
killed mid-save resumes from the previous complete checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def save_checkpoint(output_dir: str | Path, step: int, rank: int, state: dict[str, Any]) -> Path:
    """Write this rank's state for ``step``; rank 0 then marks it latest once all ranks wrote."""
    directory = checkpoint_root(output_dir) / f"step_{step:06d}"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank{rank}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save({**state, "step": step}, tmp)
    os.replace(tmp, path)
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        marker = checkpoint_root(output_dir) / "latest"
        marker.with_suffix(".tmp").write_text(f"step_{step:06d}\n")
        os.replace(marker.with_suffix(".tmp"), marker)
    if dist.is_initialized():
        dist.barrier()
    return path


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint directory, or None."""
    marker = checkpoint_root(output_dir) / "latest"
    if not marker.exists():
        return None
    return checkpoint_root(output_dir) / marker.read_text().strip()


def load_checkpoint(directory: Path, rank: int) -> dict[str, Any]:
    path = directory / f"rank{rank}.pt"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: was the run saved with a different dp size?")
    return torch.load(path, map_location="cpu", weights_only=False)
