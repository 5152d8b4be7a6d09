"""`build_sft_dataloader`: dataset + `PackingConfig` -> a resumable torchdata `StatefulDataLoader`.

Packed mode (``use_sequence_packing: true``) plans steps with `DPAlignedPackingBatchSampler`
(varying the batch size only when ``align_packing_bins_to_dp: true``), fetches each rank's own
examples with the plan attached, and collates them into `PackedBatch` objects. The loader's
``state_dict()`` holds the sampler's cursor and carry buffer, so a resume is exact, also into a
loader with another ``num_workers``; a state from another setup, or an empty one, is refused.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from megatron_packing.common.config_fields import check_field
from megatron_packing.common.validation import (
    ConfigError,
    require_bool,
    require_int,
    require_positive_int,
)
from megatron_packing.config import PackingConfig
from megatron_packing.loader.state import (
    sampler_state,
    saved_worker_count,
    steps_after_snapshot,
    stream_position,
)
from megatron_packing.packed.components import (
    build_packed_components,
    check_not_empty,
)
from megatron_packing.padded.components import build_padded_components
from megatron_packing.stream.state_checks import saved_dp_size
from megatron_packing.stream.step_stream import LiveIteratorWarning, warn_live_iterator


@dataclass(frozen=True)
class WorkerConfig:
    """The DataLoader's worker options (``build_sft_dataloader``'s keywords of the same names)."""

    num_workers: int = 0
    persistent_workers: bool = False
    prefetch_factor: int | None = None
    pin_memory: bool = False
    multiprocessing_context: Any = None

    def __post_init__(self) -> None:
        check_field(self, "num_workers", require_int, minimum=0)
        check_field(self, "persistent_workers", require_bool)
        check_field(self, "prefetch_factor", require_positive_int, allow_none=True)
        check_field(self, "pin_memory", require_bool)
        if self.num_workers == 0:  # these only shape worker processes: without any, no effect
            for name, unset in (("prefetch_factor", None), ("persistent_workers", False),
                                ("multiprocessing_context", None)):
                if getattr(self, name) != unset:
                    raise ConfigError(
                        f"{name}={getattr(self, name)!r} only applies to loader worker "
                        f"processes, but num_workers is 0 (the main process loads); set "
                        f"num_workers >= 1, or remove {name}")

    def loader_options(self) -> dict[str, Any]:
        """Keywords for the DataLoader; the worker-only ones only when there are workers."""
        options: dict[str, Any] = {"num_workers": self.num_workers, "pin_memory": self.pin_memory}
        if self.num_workers > 0:
            options["persistent_workers"] = self.persistent_workers
            if self.prefetch_factor is not None:
                options["prefetch_factor"] = self.prefetch_factor
            if self.multiprocessing_context is not None:
                options["multiprocessing_context"] = self.multiprocessing_context
        return options


GLOBAL_STATE_VERSION = 1
GLOBAL_STATE_KEYS = ("version", "dp_size", "num_workers", "sampler")


class PackingDataLoader(StatefulDataLoader):
    """A `StatefulDataLoader` that refuses a wrong state and loads one saved with other workers.

    Everything that decides the stream lives in the batch sampler's state (its iterators own
    their cursor; see `step_stream`); the dataset is map-style and keeps no state. So a state
    saved with the same ``num_workers`` goes through torchdata's own restore, and one saved with
    another ``num_workers`` is reduced to the sampler's position and loaded there.

    `stream_state` reduces a loader state to its global part (the sampler's position after the
    yielded steps, planned at the saving data-parallel size), which a loader at another
    data-parallel size or worker count resumes from with `load_stream_state`.
    """

    def _note_live_iterator(self, call: str) -> None:
        """A state loaded while an iterator of this loader runs applies from the next
        ``iter(loader)``: say so once (`LiveIteratorWarning`)."""
        live = self._iterator
        if live is not None and not live._finished and not self._initial_iter_for_state_dict:
            warn_live_iterator(self, call, "iter(loader)")

    def _load_resized(self, state_dict: dict[str, Any], saved_dp: int) -> None:
        """A state saved at another data-parallel size: its sampler position is global, so it
        loads as is where no step was yielded after the saving loader's last snapshot."""
        lag = steps_after_snapshot(state_dict)
        sampler: Any = self.batch_sampler
        if lag:
            raise ValueError(
                f"this loader state was saved at data-parallel size {saved_dp} with {lag} steps "
                f"yielded after its last snapshot; those steps were planned at size {saved_dp} "
                f"and cannot be replayed at {sampler.dp_size}. Save the global part "
                "instead (stream_state() of the saving loader) and load it with "
                "load_stream_state(), or save with snapshot_every_n_steps=1")
        self.load_stream_state({"version": GLOBAL_STATE_VERSION, "dp_size": saved_dp,
                                "num_workers": saved_worker_count(state_dict),
                                "sampler": stream_position(state_dict, None).sampler_state})

    def stream_state(self, state_dict: dict[str, Any] | None = None) -> dict[str, Any]:
        """The global part of ``state_dict`` (default: this loader's state now).

        No rank and no worker layout is in it: every rank plans the same global steps, so any
        rank's part serves a rank of a run at another size. Steps yielded after the loader's
        last snapshot are replayed on a replica of the sampler, at this loader's own size.
        """
        sampler: Any = self.batch_sampler
        state = self.state_dict() if state_dict is None else state_dict
        position = stream_position(state, sampler.replica())
        return {"version": GLOBAL_STATE_VERSION, "dp_size": int(sampler.dp_size),
                "num_workers": int(self.num_workers), "sampler": position.sampler_state}

    def check_stream_state(self, stream_state: Any) -> None:
        """Raise `ValueError` unless ``stream_state`` is a global part this loader can resume
        from (its sampler's setup checked; the data-parallel size may differ)."""
        if not isinstance(stream_state, dict) or any(k not in stream_state
                                                     for k in GLOBAL_STATE_KEYS):
            raise ValueError(f"not the global part of a loader state (expected the keys "
                             f"{', '.join(GLOBAL_STATE_KEYS)}): pass what stream_state() "
                             "returned")
        if stream_state["version"] != GLOBAL_STATE_VERSION:
            raise ValueError(f"the global part of the loader state has format version "
                             f"{stream_state['version']!r}; this build reads version "
                             f"{GLOBAL_STATE_VERSION}")
        sampler: Any = self.batch_sampler
        sampler.check_state(stream_state["sampler"])

    def load_stream_state(self, stream_state: dict[str, Any]) -> None:
        """Resume from the global part of a loader state, saved at any data-parallel size and
        worker count: the next iterator plans this loader's steps from the saved position."""
        self.check_stream_state(stream_state)
        self._note_live_iterator("PackingDataLoader.load_stream_state")  # once per loader
        sampler: Any = self.batch_sampler
        with warnings.catch_warnings():  # said once, here, for the loader's iterator
            warnings.simplefilter("ignore", LiveIteratorWarning)
            sampler.load_state_dict(stream_state["sampler"])
        super().load_state_dict({})  # no loader-level state: the next iter() starts fresh
        self.next_iter_state = None  # from the sampler's position

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state from `state_dict`, also one saved with another ``num_workers``.

        An empty or missing state is refused: torchdata would silently start from step 0.
        """
        if not isinstance(state_dict, dict) or not state_dict:
            raise ValueError(
                f"load_state_dict got {state_dict!r:.60}, not a loader state: pass the dict "
                "that loader.state_dict() returned (saved in the checkpoint); to start from "
                "the beginning, do not load a state at all"
            )
        check = getattr(self.batch_sampler, "check_state", None)
        saved = sampler_state(state_dict)
        if callable(check):  # refuse a wrong state now, not at the first iteration
            check(saved)
        self._note_live_iterator("PackingDataLoader.load_state_dict")
        sampler: Any = self.batch_sampler
        saved_dp = saved_dp_size(saved)
        if saved_dp is not None and saved_dp != getattr(sampler, "dp_size", saved_dp):
            self._load_resized(state_dict, saved_dp)
            return
        if saved_worker_count(state_dict) == self.num_workers:
            super().load_state_dict(state_dict)
            return
        with warnings.catch_warnings():  # said once, above, for the loader's iterator
            warnings.simplefilter("ignore", LiveIteratorWarning)
            position = stream_position(state_dict, self.batch_sampler)
            sampler.load_state_dict(position.sampler_state)
        super().load_state_dict({})  # no loader-level state: the next iter() starts fresh
        self.next_iter_state = None  # from the sampler's position


def build_sft_dataloader(
    dataset: Any,
    config: PackingConfig,
    *,
    dp_rank: int,
    dp_size: int,
    seed: int | None = None,
    total_steps: int | None = None,
    eval_mode: bool = False,
    base_sampler: Any = None,
    num_workers: int = 0,
    persistent_workers: bool = False,
    prefetch_factor: int | None = None,
    pin_memory: bool = False,
    multiprocessing_context: Any = None,
) -> StatefulDataLoader:
    """A `StatefulDataLoader` yielding this rank's batches, one optimizer step per item.

    Packed mode yields `PackedBatch` (one micro-batch per bin, equal counts on every rank).
    Padded mode (``use_sequence_packing: false``) yields padded micro-batches filled up to
    ``max_tokens_per_microbatch`` tokens, or of ``micro_batch_size`` examples when unset.
    ``total_steps`` is the run's horizon: the last scheduled step repays the batch-size drift.
    The worker options are the DataLoader's (`WorkerConfig` checks them: one that only shapes
    worker processes is refused without workers).
    """
    config.validate(dp_size)
    require_int("dp_rank", dp_rank, minimum=0, maximum=dp_size - 1)
    workers = WorkerConfig(num_workers, persistent_workers, prefetch_factor, pin_memory,
                           multiprocessing_context)
    check_not_empty(dataset)
    if base_sampler is not None and not hasattr(base_sampler, "__len__"):
        raise ValueError(
            f"base_sampler {type(base_sampler).__name__} has no __len__: the packing sampler "
            "needs the epoch length to plan steps and the epoch's last step"
        )
    build = build_packed_components if config.use_sequence_packing else build_padded_components
    batch_sampler, fetch_dataset, collate_fn = build(
        dataset, config, dp_rank=dp_rank, dp_size=dp_size, seed=seed, total_steps=total_steps,
        eval_mode=eval_mode, base_sampler=base_sampler,
    )
    # A generator of the loader's own: each new epoch iterator draws its workers' base seed from
    # it, never from torch's global generator, whose state the model's checkpoint saves for
    # dropout. A resumed run makes its first iterator after that state is restored, the
    # uninterrupted run made it steps before; drawn globally, the two would then drop out
    # differently.
    generator = torch.Generator().manual_seed(0 if seed is None else int(seed))
    return PackingDataLoader(fetch_dataset, batch_sampler=batch_sampler, collate_fn=collate_fn,
                             generator=generator, **workers.loader_options())


__all__ = ["PackingDataLoader", "WorkerConfig", "build_sft_dataloader"]
