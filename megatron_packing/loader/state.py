"""Reading a `StatefulDataLoader` state whatever number of loader workers saved it.

torchdata stores two layouts: a flat one with ``num_workers=0`` and a snapshot one (main-process
snapshot plus per-worker snapshots) with workers, and refuses to load one into the other. For our
loaders everything that decides the stream lives in the batch sampler's state: the dataset is
map-style and not stateful, so the worker snapshots hold nothing worth keeping. Both layouts
reduce to the batch sampler's position after the yielded steps, which a loader with any worker
count can start from. The key names are torchdata's own (imported, not spelled out here); this
module only reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchdata.stateful_dataloader.stateful_dataloader import (
    _DATASET_STATE,
    _INDEX_SAMPLER_STATE,
    _ITERABLEDATASET_LEN_CALLED,
    _ITERATOR_FINISHED,
    _SHARED_SEED,
    _StatefulMultiProcessingDataLoaderIter,
    _StatefulSingleProcessDataLoaderIter,
)

_MULTI = _StatefulMultiProcessingDataLoaderIter
_SINGLE_NUM_YIELDED = _StatefulSingleProcessDataLoaderIter._NUM_YIELDED


@dataclass
class StreamPosition:
    """Where a loader's stream stands, independent of its worker count."""

    sampler_state: Any  # the batch sampler's state after ``yielded`` steps of this epoch
    yielded: int
    finished: bool
    shared_seed: Any
    len_called: Any
    worker_base_seed: int = 0  # seeds the workers' RNGs; a map-style fetch never draws from them


def saved_worker_count(state: dict[str, Any]) -> int:
    """The ``num_workers`` a loader state was saved with (0: the single-process layout)."""
    if _MULTI._SNAPSHOT in state:
        return int(state[_MULTI._SNAPSHOT][_MULTI._MAIN_SNAPSHOT][_MULTI._NUM_WORKERS])
    if _SINGLE_NUM_YIELDED in state:
        return 0
    raise ValueError(
        "not a StatefulDataLoader state (it has neither the single-process key "
        f"{_SINGLE_NUM_YIELDED!r} nor the worker snapshot key {_MULTI._SNAPSHOT!r}; keys: "
        f"{sorted(state)[:8]}): pass the dict that loader.state_dict() returned"
    )


def sampler_state(state: dict[str, Any]) -> Any:
    """The batch sampler's saved state inside a loader state of either layout."""
    saved_worker_count(state)  # refuses a dict that is no loader state
    if _MULTI._SNAPSHOT in state:
        return state[_MULTI._SNAPSHOT][_MULTI._MAIN_SNAPSHOT].get(_INDEX_SAMPLER_STATE)
    return state.get(_INDEX_SAMPLER_STATE)


def steps_after_snapshot(state: dict[str, Any]) -> int:
    """Steps the saving loader yielded after its last worker snapshot (0 without workers)."""
    if _MULTI._SNAPSHOT not in state:
        return 0
    return int(state.get(_MULTI._STEPS_SINCE_SNAPSHOT, 0))


def stream_position(state: dict[str, Any], batch_sampler: Any) -> StreamPosition:
    """Reduce either layout to a `StreamPosition`.

    ``batch_sampler`` is used as scratch space when the snapshot lags the yielded steps (it
    replays those plans); its state is overwritten when the loader restores.
    """
    finished = bool(state.get(_ITERATOR_FINISHED, False))
    if _MULTI._SNAPSHOT not in state:
        if state.get(_DATASET_STATE) is not None:
            raise ValueError("the saved loader state holds a dataset state; it cannot move to "
                             "another num_workers without losing it")
        return StreamPosition(state[_INDEX_SAMPLER_STATE], int(state[_SINGLE_NUM_YIELDED]),
                              finished, state.get(_SHARED_SEED), state.get(_ITERABLEDATASET_LEN_CALLED))
    snapshot = state[_MULTI._SNAPSHOT]
    main = snapshot[_MULTI._MAIN_SNAPSHOT]
    for key, worker in (snapshot.get(_MULTI._WORKER_SNAPSHOTS) or {}).items():
        if worker and worker.get(_DATASET_STATE) is not None:
            raise ValueError(f"the saved loader state holds a dataset state for {key}; it cannot "
                             "move to another num_workers without losing it")
    sampler_state = main[_INDEX_SAMPLER_STATE]
    yielded = int(snapshot[_MULTI._SNAPSHOT_STEP])
    lag = int(state.get(_MULTI._STEPS_SINCE_SNAPSHOT, 0))
    if lag:  # steps yielded after the snapshot: replay their plans (no examples are read)
        batch_sampler.load_state_dict(sampler_state)
        steps = iter(batch_sampler)
        for _ in range(lag):
            next(steps)
        sampler_state = batch_sampler.state_dict()
        yielded += lag
    base_seed = main.get(_MULTI._BASE_SEED)
    return StreamPosition(sampler_state, yielded, finished, main.get(_SHARED_SEED),
                          main.get(_ITERABLEDATASET_LEN_CALLED),
                          base_seed if isinstance(base_seed, int) else 0)
