"""Reading a `StatefulDataLoader` state: its worker count and the batch sampler's state in it.

torchdata stores two layouts: a flat one with ``num_workers=0`` and a snapshot one (main-process
snapshot plus per-worker snapshots) with workers. The key names are torchdata's own (imported,
not spelled out here).
"""

from __future__ import annotations

from typing import Any

from torchdata.stateful_dataloader.stateful_dataloader import (
    _INDEX_SAMPLER_STATE,
    _StatefulMultiProcessingDataLoaderIter,
    _StatefulSingleProcessDataLoaderIter,
)

_MULTI = _StatefulMultiProcessingDataLoaderIter
_SINGLE_NUM_YIELDED = _StatefulSingleProcessDataLoaderIter._NUM_YIELDED


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
