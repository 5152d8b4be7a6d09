"""Fitting the cost model to measured micro-batch times; pure numpy.

A micro-batch holding sequences of lengths ``s_i`` (``T = sum s_i`` tokens) is modeled to take
``ms = a + b T + c sum(s_i^2)``: ``a`` per micro-batch (launches, fixed work), ``b`` per token
(the linear layers), ``c`` per squared length (causal attention, block-diagonal over the
sequences). Least squares over measured compositions, on relative error (each row divided by its
measured time, so a short micro-batch's miss counts as much as a long one's), gives the three
constants, and from them the planner's two keys in tokens of linear work:
``attention_cost_constant = b / c`` (k in ``s + s^2 / k``) and ``microbatch_cost_tokens = a / b``.

The fit needs compositions that separate the three terms: micro-batches of different token
totals (else ``a`` and ``b`` move together) and of different sequence mixes at one total (else
``b`` and ``c`` do). `fit_costs` refuses compositions whose design has rank below three.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class FitError(ValueError):
    """The compositions cannot fix the three constants (the message says why)."""


@dataclass(frozen=True)
class Measured:
    """One composition (its sequence lengths) and its measured time in ms."""

    lengths: tuple[int, ...]
    ms: float

    @property
    def tokens(self) -> int:
        return int(sum(self.lengths))

    @property
    def squares(self) -> float:
        return float(sum(float(s) * s for s in self.lengths))

    def describe(self) -> str:
        """``4 x 2048`` for equal lengths, else the lengths joined by ``+`` (shortened)."""
        if len(set(self.lengths)) == 1:
            return f"{len(self.lengths)} x {self.lengths[0]}"
        parts = [str(s) for s in self.lengths]
        return "+".join(parts) if len(parts) <= 6 else "+".join(parts[:5]) + f"+... ({len(parts)})"


@dataclass(frozen=True)
class FitRow:
    """A composition's measured and modeled time."""

    measured: Measured
    modeled_ms: float

    @property
    def relative_error(self) -> float:
        return (self.modeled_ms - self.measured.ms) / self.measured.ms


@dataclass(frozen=True)
class CostFit:
    """The fitted constants (ms per micro-batch, per token, per squared length) and each row."""

    a: float
    b: float
    c: float
    rows: tuple[FitRow, ...]

    @property
    def worst(self) -> FitRow:
        """The row the model misses most, relatively."""
        return max(self.rows, key=lambda r: abs(r.relative_error))

    @property
    def negative(self) -> list[str]:
        """The constants that came out below zero (a per-token or per-square cost of 0 too:
        the keys divide by them)."""
        out = []
        if self.a < 0:
            out.append(f"a = {self.a:.4g} ms per micro-batch")
        if self.b <= 0:
            out.append(f"b = {self.b:.4g} ms per token")
        if self.c <= 0:
            out.append(f"c = {self.c:.4g} ms per squared length")
        return out

    @property
    def attention_cost_constant(self) -> float:
        """k = b / c: the length whose attention costs as much as its linear work."""
        return self.b / self.c

    @property
    def microbatch_cost_tokens(self) -> float:
        """a / b: a micro-batch's own cost in tokens of linear work."""
        return self.a / self.b


def design_rank(measured: Sequence[Measured]) -> int:
    """How many of the three constants the compositions can fix (the design matrix's rank)."""
    if not measured:
        return 0
    design = np.array([[1.0, m.tokens, m.squares] for m in measured])
    scale = np.abs(design).max(axis=0)
    return int(np.linalg.matrix_rank(design / np.where(scale > 0, scale, 1.0)))


def fit_costs(measured: Sequence[Measured]) -> CostFit:
    """Least squares of ``ms = a + b T + c sum(s^2)`` on relative error (module docstring).
    Raises `FitError` when the compositions cannot fix all three constants."""
    rank = design_rank(measured)
    if rank < 3:
        distinct = len({(m.tokens, m.squares) for m in measured})
        raise FitError(
            f"too few distinct compositions to fit three constants: {len(measured)} timed, "
            f"{distinct} distinct (token total, sum of squared lengths), which fix {rank} of the "
            "3 (a per micro-batch, b per token, c per squared length); time micro-batches of "
            "different token totals and of different sequence mixes")
    design = np.array([[1.0, m.tokens, m.squares] for m in measured])
    ms = np.array([m.ms for m in measured])
    weighted = design / ms[:, None]
    scale = np.abs(weighted).max(axis=0)  # columns of one size: a well-conditioned solve
    solution, *_ = np.linalg.lstsq(weighted / scale, np.ones(len(ms)), rcond=None)
    a, b, c = (solution / scale).tolist()
    modeled = design @ np.array([a, b, c])
    rows = tuple(FitRow(m, float(x)) for m, x in zip(measured, modeled, strict=True))
    return CostFit(float(a), float(b), float(c), rows)
