"""How many of the next steps can still align: a backward pass over (step, boundary offset).

Boundary j of the next few steps may sit anywhere within +-v of its nominal place j x B,
consecutive boundaries within v of each other (the step-size window), the epoch's last one at
the epoch's end and the run's final one exactly at its nominal place. A backward pass gives, for
each boundary, the most steps after it that can align. Only the examples read ahead count.

Two questions, two functions:

- `future_alignment`: for each candidate size of this step, the most of the next steps that can
  align after it (the next step judged by ``judge``, later ones by ``judge_later``);
- `onward_alignment`: the next step's possible end boundaries and the most aligned steps after
  each, for a caller that judges the next step itself (by real packer counts).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from megatron_packing.packing.planner.bounds import BoundJudge, SegmentJudge
from megatron_packing.packing.planner.window import STEP_EPOCH_TAIL, STEP_NORMAL, StepContext


@dataclass(frozen=True)
class Layer:
    """The boundaries one step further ahead: offsets from their nominal places, positions
    (relative to the stream's current position), and whether it is the epoch's end."""

    offsets: np.ndarray
    positions: np.ndarray
    tail: bool


@dataclass(frozen=True)
class Onward:
    """The next step's end boundaries and the most aligned steps after each (to the horizon)."""

    layer: Layer
    best: np.ndarray

    def after(self, size: int, context: StepContext) -> tuple[int, np.ndarray | None]:
        """After taking ``size`` now: the most aligned steps beyond the next one, and the next
        step's end boundaries that reach it; (-1, None) when the next step has no admissible end."""
        valid = self.layer.positions - size >= 1
        if not self.layer.tail:
            drift = context.drift + size - context.batch_size
            valid &= np.abs(self.layer.offsets - drift) <= context.v
        if not valid.any():
            return -1, None
        most = int(self.best[valid].max())
        return most, self.layer.positions[valid & (self.best == most)]


def boundary_layers(context: StepContext, first_size: int, horizon: int, available: int) -> list[Layer]:
    """The boundaries of the steps after this one, up to ``horizon`` steps in all."""
    batch, v = context.batch_size, context.v
    # The stream stands at (steps taken) x B + drift, so the boundary after ``layer`` more
    # steps, ``offset`` from its nominal place, is ``layer x B - drift + offset`` ahead.
    layers: list[Layer] = []
    step_context = context.after(first_size)
    for layer in range(2, horizon + 1):
        if step_context is None:
            break
        kind = step_context.kind
        if kind == STEP_EPOCH_TAIL:  # the epoch's last step ends exactly at its end
            offsets = np.zeros(1, dtype=np.int64)
            positions = np.array([context.remaining], dtype=np.int64)
        else:  # +-v while the drift may float; 0 for the run's final step, which repays it
            offsets = (np.arange(-v, v + 1, dtype=np.int64) if kind == STEP_NORMAL
                       else np.zeros(1, dtype=np.int64))
            positions = layer * batch - context.drift + offsets
            # Leave at least one example for each later step of the epoch.
            keep = positions <= context.remaining - (step_context.steps_left_in_epoch - 1)
            offsets, positions = offsets[keep], positions[keep]
        keep = positions <= available  # only what was read ahead can be judged
        offsets, positions = offsets[keep], positions[keep]
        if positions.size == 0:
            break
        layers.append(Layer(offsets, positions, kind == STEP_EPOCH_TAIL))
        # Only the kind of the following steps matters here, not their drift.
        step_context = replace(step_context, drift=0).after(batch)
    return layers


def best_onward(offsets: np.ndarray, positions: np.ndarray, following: Layer,
                best_after: np.ndarray, judge: SegmentJudge, v: int) -> np.ndarray:
    """Most aligned steps from each boundary, over the step to ``following`` and on (-1: none).

    The bound's judge answers a large grid row by row (`BoundJudge.best_in_ranges`): each
    row's valid next boundaries are one run of them."""
    # A step takes at least one example, and its size B + (offset change) stays within
    # B +- v, so consecutive offsets differ by at most v (the tail takes what is left).
    ends = following.positions
    if (isinstance(judge, BoundJudge) and judge.by_ranges(positions.size, ends.size)
            and bool((np.diff(ends) > 0).all())
            and (following.tail or bool((np.diff(following.offsets) > 0).all()))):
        # Each row's valid next boundaries are one run of columns: after the row's position,
        # and (before the epoch's end) with an offset within v of the row's.
        low = np.searchsorted(ends, positions + 1, side="left")
        if following.tail:
            high = np.full(positions.shape, ends.size, dtype=np.int64)
        else:
            low = np.maximum(low, np.searchsorted(following.offsets, offsets - v, side="left"))
            high = np.searchsorted(following.offsets, offsets + v, side="right")
        return judge.best_in_ranges(positions, ends, low, high, best_after)
    valid = following.positions[None, :] - positions[:, None] >= 1
    if not following.tail:
        valid &= np.abs(following.offsets[None, :] - offsets[:, None]) <= v
    if judge.broadcasts:
        # O(1) per pair from prefix sums: judge the whole grid at once (no gathers).
        ok = judge(positions[:, None], following.positions[None, :])
        return np.where(valid, ok + best_after[None, :], -1).max(axis=1)
    rows, cols = np.nonzero(valid)
    gain = np.full(valid.shape, -1, dtype=np.int64)  # -1: no valid step (never chosen)
    ok = judge(positions[rows], following.positions[cols]).astype(np.int64)
    gain[rows, cols] = ok + best_after[cols]
    return gain.max(axis=1)


def _backward(layers: list[Layer], judge: SegmentJudge, v: int) -> np.ndarray:
    """Most aligned steps from each boundary of the first layer to the horizon."""
    best = np.zeros(layers[-1].positions.size, dtype=np.int64)
    for index in range(len(layers) - 2, -1, -1):
        layer = layers[index]
        best = best_onward(layer.offsets, layer.positions, layers[index + 1], best, judge, v)
    return best


def future_alignment(judge: SegmentJudge, available: int, context: StepContext, sizes: list[int],
                     horizon: int, judge_later: SegmentJudge | None = None) -> dict[int, int]:
    """For each size in ``sizes``: how many of the next ``horizon - 1`` steps can align after it."""
    layers = boundary_layers(context, sizes[0], horizon, available) if sizes else []
    chosen = np.asarray(sizes, dtype=np.int64)
    if not layers:
        return {int(k): 0 for k in chosen}
    best = _backward(layers, judge_later or judge, context.v)
    # Taking k examples now leaves the first boundary at offset drift + k - B.
    future = best_onward(context.drift + chosen - context.batch_size, chosen, layers[0], best,
                         judge, context.v)
    return {int(k): max(int(f), 0) for k, f in zip(chosen, future, strict=True)}


def onward_alignment(judge: SegmentJudge, available: int, context: StepContext, sizes: list[int],
                     horizon: int) -> Onward | None:
    """The next step's end boundaries and the most aligned steps after each; None when no
    later step can be judged."""
    layers = boundary_layers(context, sizes[0], horizon, available) if sizes else []
    if not layers:
        return None
    return Onward(layers[0], _backward(layers, judge, context.v))
