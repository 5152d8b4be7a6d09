"""The loader state in Bridge's checkpoints: written by Bridge's hook, read back by the host.

Bridge's ``save_checkpoint`` writes ``iterable.save_state()`` of the training iterator once per
DP rank as ``<dataloader dir>/iter_NNNNNNN/train_dataloader_dprankDDD.pt`` (by default the
``energon`` folder under ``checkpoint.save``). Bridge restores only iterables with
``restore_state()`` and only at the saved data-parallel size; the host restores itself instead,
through Bridge's restricted unpickler, so that a run at another DP size resumes from DP rank 0's
file, whose global part (`TrainStream.state_dict`) every rank plans from.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from megatron_packing.config import ConfigError
from megatron_packing.megatron.train_stream import TrainStream

_STATE_FILE = re.compile(r"train_dataloader_dprank(\d{3})\.pt")


class LoaderStateRefused(ConfigError):
    """A checkpoint's loader state is missing, incomplete, or does not fit this run."""


def loader_state_dir(cfg: Any, checkpoint_manager: Any) -> str | None:
    """Where the loaded checkpoint's loader states are, as Bridge resolves it."""
    explicit = getattr(cfg.dataset, "dataloader_load", None)
    if explicit:
        return str(explicit)
    context = getattr(checkpoint_manager, "checkpointing_context", None) or {}
    found = context.get("dataloader_state_dir")
    return None if found is None else str(found)


def saved_states(directory: str, iteration: int) -> dict[int, Path]:
    """The loader states saved with ``iteration``, by DP rank."""
    from megatron.bridge.training.utils.checkpoint_utils import get_checkpoint_name

    base = Path(get_checkpoint_name(directory, iteration))
    found = {}
    if base.is_dir():
        for path in sorted(base.iterdir()):
            match = _STATE_FILE.fullmatch(path.name)
            if match:
                found[int(match.group(1))] = path
    return found


def read_state(path: Path) -> dict[str, Any]:
    """One saved state, through Bridge's restricted unpickler (no arbitrary objects)."""
    from megatron.bridge.utils.safe_pickle import energon_torch_load

    saved = energon_torch_load(str(path))
    if not isinstance(saved, dict) or not isinstance(saved.get("dataloader_state_dict"), dict):
        raise LoaderStateRefused(f"{path} is not a loader state written by Bridge's dataloader "
                                 "hook; resume from a checkpoint the Bridge host saved")
    state: dict[str, Any] = saved["dataloader_state_dict"]
    return state


def restore(stream: TrainStream, directory: str | None, iteration: int, *, dp_rank: int,
            dp_size: int, consumed_samples: int) -> str:
    """Load this rank's saved state into ``stream`` (its own at the saved size, else DP rank
    0's global part); return a line for the start-up log. Refuses, naming the file, a state that
    is missing, incomplete, or not this run's."""
    where = directory or "(no dataloader state directory)"
    states = saved_states(directory, iteration) if directory and os.path.isdir(directory) else {}
    if not states:
        raise LoaderStateRefused(
            f"checkpoint iteration {iteration} has no packing loader state under {where}: it was "
            "not saved by the Bridge host (or dataset.dataloader_save points elsewhere); resuming "
            "without it would replay or skip examples. Resume from a checkpoint the host saved, "
            "or load it as a pretrained checkpoint (checkpoint.pretrained_checkpoint) to start the "
            "data from the beginning")
    saved_dp = len(states)
    if sorted(states) != list(range(saved_dp)):
        raise LoaderStateRefused(
            f"{where}: iteration {iteration} holds loader states for data-parallel ranks "
            f"{sorted(states)}, not 0..{max(states)}: the checkpoint is incomplete")
    path = states[dp_rank] if saved_dp == dp_size else states[0]
    state = read_state(path)
    try:
        stream.check_state(state)
        stream.load_state_dict(state)
    except ValueError as error:
        raise LoaderStateRefused(f"resuming from {path}: {error}") from error
    if stream.counter.examples != consumed_samples:
        raise LoaderStateRefused(
            f"{path}: the loader state counts {stream.counter.examples} examples but the "
            f"checkpoint's consumed_train_samples is {consumed_samples}; it was not written "
            "with this checkpoint by the Bridge host")
    note = ("" if saved_dp == dp_size else
            f" (saved at data-parallel size {saved_dp}, now {dp_size}: the rest of the run is "
            "planned at the new size from DP rank 0's global part)")
    return f"restored the packing loader state of iteration {iteration} from {path}{note}"
