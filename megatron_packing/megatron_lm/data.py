"""Per-rank loaders for the Megatron-LM entry point, and their state inside Megatron's checkpoints.

Every rank builds its own loader from the same seed and lengths, keyed by its data-parallel
rank: the ranks of one tensor-, context- or pipeline-parallel group share a DP rank, so they
plan and fetch the same rows and agree on each step's micro-batch count without a collective.

The loader state travels through Megatron-LM's own dataloader hook: ``save_checkpoint(...,
train_data_iterator=...)`` calls ``train_data_iterator.iterable.save_state()`` and writes the
result as ``iter_NNNNNNN/mp_rank_00/train_dataloader_dprankDDD.pt`` under ``--save``, once per
DP rank, before the checkpoint's tracker file names the iteration. Restoring is the entry
point's job: `read_loader_state` and `check_loader_state` before the model is built (a state
this run cannot continue from is refused then), `restore_loader_state` once ``load_checkpoint``
has returned the same iteration.

Each saved state carries a global part (`TrainStream.state_dict`), the same on every rank. A run
at another data-parallel size (a lost node, more nodes granted; tensor / pipeline sizes changed
too, where Megatron's torch_dist format reshards the model) reads DP rank 0's file and plans its
own steps from that part: the same cursor, carry and drift, handed out to its own ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_packing.common.validation import ConfigError
from megatron_packing.megatron.train_stream import TrainStream

LOADER_STATE_BASENAME = "train_dataloader_dprank{dp_rank:03d}.pt"


def checkpoint_hook(stream: TrainStream) -> Any:
    """The object to pass as ``save_checkpoint(..., train_data_iterator=...)``.

    Megatron-LM wraps its own training iterator in megatron-core's ``RerunDataIterator``, whose
    ``.iterable`` its dataloader hook asks for ``save_state()``; the stream is wrapped the same
    way, so the hook and the rerun state machine's checkpoint both see what they expect.
    """
    from megatron.core.rerun_state_machine import RerunDataIterator

    return RerunDataIterator(stream)


def loader_state_path(checkpoint_dir: str, iteration: int, dp_rank: int) -> str:
    """Where Megatron-LM's hook writes DP rank ``dp_rank``'s loader state for ``iteration``
    under this run's tensor / pipeline layout."""
    from megatron.training.checkpointing import get_checkpoint_name

    return get_checkpoint_name(checkpoint_dir, iteration, tensor_rank=0, pipeline_rank=0,
                               expert_rank=0, basename=LOADER_STATE_BASENAME.format(dp_rank=dp_rank))


def saved_loader_states(checkpoint_dir: str, iteration: int) -> dict[int, Path]:
    """The loader states saved with ``iteration``, by DP rank, whatever tensor / pipeline /
    expert layout wrote them (``iter_NNNNNNN/mp_rank_*/train_dataloader_dprankDDD.pt``)."""
    from megatron.training.checkpointing import get_checkpoint_name

    base = Path(get_checkpoint_name(checkpoint_dir, iteration, return_base_dir=True))
    found: dict[int, Path] = {}
    for path in sorted(base.glob("mp_rank_*/" + LOADER_STATE_BASENAME.replace(
            "{dp_rank:03d}", "[0-9][0-9][0-9]"))):
        found.setdefault(int(path.stem.removeprefix("train_dataloader_dprank")), path)
    return found


def checkpoint_to_load(args: Any) -> tuple[int, str] | None:
    """(iteration, directory) of the checkpoint ``--load`` will take, as Megatron chooses it.

    The persistent tracker under ``--load`` (or ``--ckpt-step``), unless a global non-persistent
    checkpoint is at least as new. None when there is nothing to load.
    """
    from megatron.training.checkpointing import get_checkpoint_tracker_filename

    def tracked(directory: str) -> int:
        tracker = get_checkpoint_tracker_filename(directory)
        if not os.path.isfile(tracker):
            return -1
        text = Path(tracker).read_text().strip()
        return int(text) if text.isdigit() else -1

    iteration = tracked(args.load)
    if getattr(args, "ckpt_step", None):
        iteration = int(args.ckpt_step)
    choice = (iteration, args.load)
    if getattr(args, "non_persistent_ckpt_type", None) == "global":
        directory = args.non_persistent_global_ckpt_dir or os.path.join(args.load,
                                                                         "non_persistent")
        newer = tracked(directory)
        if newer >= iteration and newer > 0:
            choice = (newer, directory)
    return choice if choice[0] > 0 else None


class LoaderStateMissing(FileNotFoundError):
    """A checkpoint to resume from holds no loader state for this rank."""


class LoaderStateRefused(ConfigError):
    """The saved loader state does not fit this run (another dataset, seed, B, packing, ...)."""


def missing_loader_state(checkpoint_dir: str, iteration: int, dp_rank: int,
                         path: str) -> LoaderStateMissing:
    return LoaderStateMissing(
        f"checkpoint iteration {iteration} under {checkpoint_dir} has no loader state for "
        f"data-parallel rank {dp_rank} (expected {path}). It was not written by the "
        "megatron_packing entry point; resuming without it would replay or skip examples. "
        "Start from a checkpoint this entry point saved, or pass --finetune to start the data "
        "from the beginning")


@dataclass
class SavedLoaderState:
    """The loader state a rank resumes from, read once (before the model is built)."""

    path: Path
    state: dict[str, Any]
    saved_dp_size: int
    iteration: int


def read_loader_state(checkpoint_dir: str, iteration: int, dp_rank: int,
                      dp_size: int) -> SavedLoaderState:
    """The state this rank resumes from: its own DP rank's at the saved data-parallel size, else
    DP rank 0's, whose global part every rank of a run at another size plans from.

    Raises `LoaderStateMissing` when the checkpoint holds none, and `LoaderStateRefused` for a
    damaged set or a resume at another size from a state without the global part.
    """
    states = saved_loader_states(checkpoint_dir, iteration)
    if not states:
        raise missing_loader_state(checkpoint_dir, iteration, dp_rank,
                                   loader_state_path(checkpoint_dir, iteration, dp_rank))
    saved_dp = len(states)
    if sorted(states) != list(range(saved_dp)):
        absent = sorted(set(range(max(states) + 1)) - set(states))
        raise LoaderStateRefused(
            f"checkpoint iteration {iteration} under {checkpoint_dir} holds loader states for "
            f"data-parallel ranks {sorted(states)} but not {absent}: it is incomplete; resume "
            "from a complete checkpoint")
    path = states[dp_rank] if saved_dp == dp_size else states[0]
    state = _read(path)
    if saved_dp != dp_size and "global" not in state:
        raise LoaderStateRefused(
            f"{path}: this checkpoint was saved at data-parallel size {saved_dp} by an earlier "
            "release, whose loader state has no global part to plan from at another size; "
            f"resume it at data-parallel size {saved_dp} (now {dp_size}), or start the data "
            "from the beginning with --finetune")
    return SavedLoaderState(path, state, saved_dp, iteration)


def _read(path: Path) -> dict[str, Any]:
    saved = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(saved, dict) or not isinstance(saved.get("dataloader_state_dict"), dict):
        raise LoaderStateRefused(f"{path} is not a loader state written by Megatron-LM's "
                                 "dataloader hook; resume from a checkpoint this entry point "
                                 "saved")
    state: dict[str, Any] = saved["dataloader_state_dict"]
    return state


def check_loader_state(stream: TrainStream, saved: SavedLoaderState) -> None:
    """Refuse a saved loader state this run cannot continue from, naming the file."""
    try:
        stream.check_state(saved.state)
    except ValueError as error:
        raise LoaderStateRefused(f"resuming from {saved.path}: {error}") from error


def restore_loader_state(stream: TrainStream, saved: SavedLoaderState) -> None:
    """Load a checked saved state into the stream (exact at the saved size and workers, else
    from its global part)."""
    try:
        stream.load_state_dict(saved.state)
    except ValueError as error:
        raise LoaderStateRefused(f"resuming from {saved.path}: {error}") from error
