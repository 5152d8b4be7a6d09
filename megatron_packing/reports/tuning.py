"""The capacity x variation grid of ``megatron-packing tune`` and the rule that picks a point.

Pure functions over numbers: the grid (which points can run at all, and why the others cannot)
and `recommend`. Running a point's simulation is `config_simulation.simulate_steps` (the
shared step engine, `steps.run_steps`).

The rule, in order:

0. **Never a point that truncates most examples.** A point whose simulation truncates more
   than half of its examples (``MOST_TRUNCATED``) is marked in the table and never recommended:
   its fill is high only because the examples were cut to fit (``--capacities 1`` would fill
   100% with one token per example). When every point is such, nothing is recommended.
1. **Cut no more than now.** Points that truncate more examples than the current setting
   (capacity, variation) does are set aside: a smaller capacity that cuts examples trains on
   fewer tokens. (When the current setting is not in the grid, the fewest truncated examples of
   any runnable point is the bar.) Truncating fewer is allowed but not sought: that trade is
   the user's, and the table shows it.
2. **Compute efficiency first.** Fill is real tokens / (every bin x capacity), padding bins
   included, so it is the share of the micro-batches' token slots doing real work. The points
   within ``fill_tolerance`` (half a percentage point) of the best fill form the shortlist.
3. **Change as little as possible.** From the shortlist, take the capacity closest to the
   current one (a capacity change moves memory per micro-batch and the model's sequence
   length), then the smallest variation (a wider window only adds batch-size swing and
   per-step token variation), then the most aligned steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from megatron_packing.common.validation import allowed_batch_variation

DEFAULT_CAPACITY_FACTORS = (0.5, 1.0, 2.0)
DEFAULT_VARIATIONS = (0.02, 0.05, 0.1, 0.2)
TUNE_MAX_STEPS = 200  # steps per grid point by default: a short simulation each
FILL_TOLERANCE = 0.005
MOST_TRUNCATED = 0.5
"""A point truncating more than this share of its simulated examples is never recommended."""


@dataclass(frozen=True)
class GridPoint:
    """One (capacity, variation) setting; ``problem`` says why it cannot run (None: it can)."""

    bin_capacity: int
    variation: float
    v: int
    problem: str | None = None


def capacity_grid(current: int, *, bin_multiple: int = 1,
                  factors: Sequence[float] = DEFAULT_CAPACITY_FACTORS) -> list[int]:
    """Capacities around the current one, rounded down to the per-bin alignment multiple."""
    out = []
    for factor in factors:
        capacity = int(current * factor) // bin_multiple * bin_multiple
        if capacity >= max(bin_multiple, 16) and capacity not in out:
            out.append(capacity)
    if current not in out:
        out.append(current)
    return sorted(out)


def make_grid(capacities: Sequence[int], variations: Sequence[float], *, batch_size: int,
              dp_size: int) -> list[GridPoint]:
    """Every (capacity, variation) pair, each marked with why it cannot run, if it cannot.

    A variation needs a window of at least one example (v = floor(B x variation) >= 1) and
    B - v >= dp, so every rank gets a real example in every step.
    """
    points = []
    for capacity in sorted(set(capacities)):
        for variation in sorted(set(variations)):
            v = allowed_batch_variation(batch_size, variation)
            problem = None
            if not 0 < variation < 1:
                problem = f"variation {variation} is outside (0, 1)"
            elif v < 1:
                problem = f"v = floor({batch_size} x {variation}) = 0: no window"
            elif batch_size - v < dp_size:
                problem = f"B - v = {batch_size - v} < dp = {dp_size}"
            points.append(GridPoint(capacity, variation, v, problem))
    return points


@dataclass
class TunePoint:
    """What one grid point's simulation measured (aligned runs)."""

    bin_capacity: int
    variation: float
    v: int
    token_fill: float  # real tokens / (bins x capacity), padding bins included
    aligned_fraction: float
    token_cv: float
    micro_batches_per_rank: float
    padding_bins: int
    truncated_examples: int
    batch_size_min: int = 0
    batch_size_max: int = 0
    problem: str | None = None  # why the point did not run (then the figures are zeros)
    examples: int = 0  # examples in the simulated steps (the truncated share's denominator)
    # modeled run time per 1,000 examples, in tokens of work (`step_time`: the config's cost keys)
    modeled_per_1000: float = 0.0

    @property
    def ran(self) -> bool:
        return self.problem is None

    @property
    def truncates_most(self) -> bool:
        """More than `MOST_TRUNCATED` of the simulated examples were cut to the capacity."""
        return truncates_most(self.truncated_examples, self.examples)

    def to_json(self) -> dict:
        return asdict(self)


def truncates_most(truncated: int, examples: int) -> bool:
    """Whether ``truncated`` of ``examples`` is more than `MOST_TRUNCATED` of them."""
    return examples > 0 and truncated > MOST_TRUNCATED * examples


@dataclass
class Recommendation:
    """The chosen point (None when no point ran) and the reasons, in plain sentences."""

    point: TunePoint | None
    reasons: list[str] = field(default_factory=list)
    shortlist: list[TunePoint] = field(default_factory=list)


def recommend(points: Sequence[TunePoint], *, current_capacity: int, current_variation: float,
              fill_tolerance: float = FILL_TOLERANCE) -> Recommendation:
    """Pick a point by the module's rule and say why."""
    ran = [p for p in points if p.ran]
    if not ran:
        return Recommendation(None, ["no grid point could run: " + "; ".join(
            sorted({p.problem or "" for p in points}))])
    marked = sorted({p.bin_capacity for p in ran if p.truncates_most})
    ran = [p for p in ran if not p.truncates_most]
    if not ran:
        return Recommendation(None, [
            "no recommendation: every grid point that ran truncates most of its examples "
            f"(capacity {', '.join(map(str, marked))}); try larger --capacities"])
    current = next((p for p in ran if p.bin_capacity == current_capacity
                    and math.isclose(p.variation, current_variation)), None)
    bar = current.truncated_examples if current is not None else min(
        p.truncated_examples for p in ran)
    kept = [p for p in ran if p.truncated_examples <= bar]
    best_fill = max(p.token_fill for p in kept)
    shortlist = [p for p in kept if p.token_fill >= best_fill - fill_tolerance]

    def closeness(p: TunePoint) -> tuple[float, float, float]:
        return (abs(math.log(p.bin_capacity / current_capacity)), p.variation, -p.aligned_fraction)

    chosen = min(shortlist, key=closeness)
    reasons = [
        f"fill {chosen.token_fill:.2%} of every micro-batch's token slots (best in the grid "
        f"{best_fill:.2%}; points within {fill_tolerance * 100:g} percentage points of it count "
        "as equal)",
        f"{chosen.aligned_fraction:.1%} of steps aligned to dp, {chosen.padding_bins} padding "
        f"bins, per-step token CV {chosen.token_cv:.2%}, batch size "
        f"{chosen.batch_size_min}-{chosen.batch_size_max}, "
        f"{chosen.micro_batches_per_rank:.2f} micro-batches per rank",
    ]
    if marked:
        reasons.append(f"capacity {', '.join(map(str, marked))} not ranked: it truncates more "
                       f"than {MOST_TRUNCATED:.0%} of the examples")
    if chosen.truncated_examples:
        reasons.append(f"it truncates {chosen.truncated_examples:,} of {chosen.examples:,} "
                       "simulated examples to the capacity (oversize_policy: truncate): their "
                       "tail tokens are not trained")
    cut = sorted({p.bin_capacity for p in ran if p.truncated_examples > bar})
    if cut:
        reasons.append(f"capacity {', '.join(map(str, cut))} set aside: it truncates more than "
                       f"the {bar} examples the current setting truncates")
    if chosen.bin_capacity != current_capacity:
        direction = "more memory per micro-batch" if chosen.bin_capacity > current_capacity \
            else "less memory per micro-batch"
        reasons.append(f"bin_capacity {current_capacity} -> {chosen.bin_capacity} ({direction}; "
                       "the model's sequence length must allow it)")
    else:
        reasons.append(f"keeps bin_capacity {current_capacity}: no other capacity that truncates "
                       "no more fills better by more than the tolerance")
    wider = sorted((p for p in shortlist if p.bin_capacity == chosen.bin_capacity
                    and p.variation > chosen.variation), key=lambda p: p.variation)
    if wider:
        reasons.append(f"the smallest variation of the shortlist at this capacity: "
                       f"{', '.join(f'{p.variation:g}' for p in wider)} fill within the tolerance "
                       "of it and swing the batch size more")
    if current is not None and current is not chosen:
        reasons.append(f"the current setting (C={current.bin_capacity}, variation "
                       f"{current.variation:g}) fills {current.token_fill:.2%} with "
                       f"{current.aligned_fraction:.1%} of steps aligned")
    elif current is chosen:
        reasons.append("this is the current setting")
    return Recommendation(chosen, reasons, shortlist)
