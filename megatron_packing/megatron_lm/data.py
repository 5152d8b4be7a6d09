"""Per-rank loaders for the Megatron-LM entry point, and their state inside Megatron's checkpoints.

Every rank builds its own loader from the same seed and lengths, keyed by its data-parallel
rank: the ranks of one tensor-, context- or pipeline-parallel group share a DP rank, so they
plan and fetch the same rows and agree on each step's micro-batch count without a collective.

The loader state travels through Megatron-LM's own dataloader hook: ``save_checkpoint(...,
train_data_iterator=...)`` calls ``train_data_iterator.iterable.save_state()`` and writes the
result as ``iter_NNNNNNN/mp_rank_00/train_dataloader_dprankDDD.pt`` under ``--save``, once per
DP rank, before the checkpoint's tracker file names the iteration. Restoring is the entry
point's job (`restore_loader_state`), keyed by the iteration ``load_checkpoint`` returned.
"""

from __future__ import annotations

import os
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
    """Where Megatron-LM's hook writes DP rank ``dp_rank``'s loader state for ``iteration``."""
    from megatron.training.checkpointing import get_checkpoint_name

    return get_checkpoint_name(checkpoint_dir, iteration, tensor_rank=0, pipeline_rank=0,
                               expert_rank=0, basename=LOADER_STATE_BASENAME.format(dp_rank=dp_rank))


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
    """The saved loader state does not fit this run (another dataset, seed, B, dp, ...)."""


def missing_loader_state(checkpoint_dir: str, iteration: int, dp_rank: int,
                         path: str) -> LoaderStateMissing:
    return LoaderStateMissing(
        f"checkpoint iteration {iteration} under {checkpoint_dir} has no loader state for "
        f"data-parallel rank {dp_rank} (expected {path}). It was not written by the "
        "megatron_packing entry point, or with a different data-parallel size; resuming "
        "without it would replay or skip examples. Start from a checkpoint this entry point "
        "saved, or pass --finetune to start the data from the beginning")


def restore_loader_state(stream: TrainStream, checkpoint_dir: str, iteration: int,
                         dp_rank: int) -> str:
    """Load the loader state saved with checkpoint ``iteration``; a clear error when absent."""
    path = loader_state_path(checkpoint_dir, iteration, dp_rank)
    if not os.path.isfile(path):
        raise missing_loader_state(checkpoint_dir, iteration, dp_rank, path)
    saved = torch.load(path, map_location="cpu", weights_only=False)
    try:
        stream.load_state_dict(saved["dataloader_state_dict"])
    except ValueError as error:
        raise LoaderStateRefused(f"resuming from {path}: {error}") from error
    return path
