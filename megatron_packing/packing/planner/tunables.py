"""Every tuned constant of the step planner, in one record, with the measurement behind it.

"The six study geometries" are those of ``benchmarks/bench_reference_study.py`` (B / capacity /
dp: 128/4K/8, 128/4K/16, 256/16K/8, 512/32K/8, 512/32K/16, 1024/64K/8; 677 steps of the mixed
shipped pools). ``benchmarks/bench_planner_constants.py`` halves and doubles each field and
prints how bins, aligned share and token CV move (``benchmarks/results/bench_planner_constants.md``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlannerTunables:
    """The planner's tuned constants. Pure caches (``memo_examples``, ``grids_remembered``,
    ``grid_cache_cells``) change only speed, never a plan."""

    max_packs: int | None = 8
    """Packs a large window's search may spend (None: every size). Chosen on the six study
    geometries (``bench_reference_study.py``): the packers reach the bound on almost every real
    step at B >= 512, so the eighth pack rarely aligns a step the seventh did not."""

    unlikely_packs: int = 3
    """The large-window budget when no size's bound is a multiple of dp, so that a step rarely
    aligns: at most this many packs before padding. Chosen with ``max_packs`` on the study
    geometries, to keep the median plan time at B = 1024 near 5 ms (``bench_step_planning.py``)."""

    bound_slack: int = 1
    """A size whose bound is at most this many bins below a multiple of dp is still tried (tier
    1): the packers exceed the bound by one bin far more often than by two (study geometries)."""

    full_search_examples: int = 16_384
    """Every size is packed when (sizes in the window) x (largest size) is at most this: B = 128
    and 256 at variation 0.05, where a fixed budget was behind the exhaustive search (2,776
    bins against 2,768 at 64/4K/dp8, ``test_never_behind_the_exhaustive_search_on_a_small_window``)."""

    exact_lookahead_examples: int = 32_768
    """Planning ahead packs the next step's real segments when (sizes)^2 x (largest size) is at
    most this (B = 128 at variation 0.05), where the bound is loose for examples of a third of
    the capacity (36 aligned steps against 31 greedy, ``test_lookahead_aligns_more_steps_than_greedy``)."""

    lookahead_steps: int = 6
    """Steps planned together. Against 3 on the study geometries: 64.3% against 61.0% aligned at
    128/4K/dp8, bins fewer or the same, about 1 ms more per step at B = 1024."""

    padding_weight: float = 0.3
    """What a padding bin of a padded step weighs against its squared token distance from the
    anchor (in fixed-B token spreads). Study geometries, two streams: at 0.2-0.4 each keeps fewer
    bins than the exhaustive search and a token CV no higher than fixed B's; padding first raises
    the CV at dp 16; tokens alone lose bins at dp 8."""

    defer_tries: int = 3
    """Deferring the largest examples tries the fewest the token bound allows, then this many
    more counts: on the deferral geometry of ``tests/golden`` a fourth try never aligned a step."""

    repair_budget: int = 8
    """Evictions the fixed-count repacking (``packing.rebin.fit_into_count``) may make before it
    gives up: each strictly shrinks the leftover total, and on real steps the repair that
    succeeds does so within a few evictions."""

    grid_cache_cells: int = 256
    """(boundary x next boundary) grids of at least this many cells are remembered across steps;
    smaller ones are judged anew, cheaper than hashing their key (a pure cache)."""

    grids_remembered: int = 12
    """Grids remembered across steps: about two steps' worth at ``lookahead_steps`` = 6 (a
    pure cache)."""

    memo_examples: int = 65_536
    """Packed segments remembered across steps, counted in examples held: about three steps'
    segments of the exact lookahead at B = 128 (a pure cache)."""


DEFAULT_TUNABLES = PlannerTunables()
DEFAULT_LOOKAHEAD_STEPS = DEFAULT_TUNABLES.lookahead_steps
