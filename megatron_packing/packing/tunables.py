"""Every tuned constant of the step planner, in one record, with the measurement behind it.

"The six study geometries" are those of ``benchmarks/bench_reference_study.py`` (B / capacity /
dp: 1024/64K/4, 1024/64K/8, 256/16K/8, 512/32K/16, 128/4K/8, 128/4K/4; 677 steps of the mixed
shipped pools). "The sweep" is ``benchmarks/bench_planner_constants.py``: each field halved and
doubled on 128/4K/8 (150 steps), 256/16K/8 (100), 1024/64K/8 (40) and 128/4K/8 with deferral 8
(150), saved in ``benchmarks/results/bench_planner_constants.md``. Where a field says "no
change", bins, aligned steps, token CV and step-time CV were all identical at x0.5 and x2 on
those four: the outcome there does not rest on the exact value, only speed does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlannerTunables:
    """The planner's tuned constants. Pure caches (``memo_examples``, ``grids_remembered``,
    ``grid_cache_cells``) and ``range_judge_cells`` change only speed, never a plan (the sweep
    confirms it)."""

    unlikely_packs: int = 3
    """The large-window budget when no size's bound is a multiple of dp (a step then rarely
    aligns). Basis: inherited with ``max_packs`` from the study geometries; no measurement of
    its own. Sweep: no change at 1 or 6."""

    bound_slack: int = 1
    """A size whose bound is at most this many bins below a multiple of dp is still tried
    (tier 1). Basis: inherited, no measurement of its own. Sweep: no change at 0; at 2, one
    aligned step fewer and token CV -0.24 points at 1024/64K/8, no change elsewhere."""

    full_search_examples: int = 16_384
    """Every size is packed when (sizes in the window) x (largest size) is at most this: B = 128
    and 256 at variation 0.05. Basis: a fixed budget of 8 packs was behind the exhaustive search
    at 64/4K/dp8 (2,776 bins against 2,768; whole-window search 2,752:
    ``test_never_behind_the_exhaustive_search_on_a_small_window``). Sweep: no change at 8,192 or
    32,768 (the sweep's windows are 13, 25 and 103 sizes; none crosses the threshold)."""

    exact_lookahead_examples: int = 32_768
    """Planning ahead packs the next step's real segments when (sizes)^2 x (largest size) is at
    most this (B = 128 at variation 0.05), where the bound is loose for examples of a third of
    the capacity. Basis: 36 aligned steps against 31 greedy at 128/4K/dp8
    (``test_lookahead_aligns_more_steps_than_greedy``). Sweep: bins and aligned steps unchanged at
    16,384 (where B = 128 falls back to the bounded search; the CV moves by under 0.01 points
    with deferral) and at 65,536."""

    padding_weight: float = 0.3
    """What a padding bin of a padded step weighs against its squared token distance from the
    anchor (in fixed-B token spreads). Basis: on the study geometries and two streams, at
    0.2-0.4 each keeps fewer bins than the exhaustive search and a token CV no higher than fixed
    B's; padding first raises the CV at dp 16; tokens alone lose bins at dp 8. Sweep: at 0.15,
    +8 bins at 128/4K/8; at 0.6, -8 bins and +1 aligned there but token CV +0.12 points at
    256/16K/8 (a 150-step stream; the basis ran 677 steps)."""

    floor_margin_spreads: float | None = 2.0
    """A step whose size nearest the nominal tokens packs into its floor takes that size
    instead of aligning when no step ahead could fall a multiple of dp even this many fixed-B
    token spreads below its smallest size's bound (`floor.no_step_can_drop`); None: a step that
    can align always does. Basis: the six study geometries (677 steps, each value through
    ``reports.simulation.simulate`` with ``tunables``), the smallest margin at which they plan
    as with None: at 0, bins behind the exhaustive search at four (1024/64K/8: 27,256 against
    27,208; 256/16K/8: 24,104 against 23,968; 512/32K/16: 30,736 against 30,528; 128/4K/8:
    28,648 against 28,584); at 1, the same bins, 55.5% aligned against 56.9% at 1024/64K/8; at
    2, 3 and 4 (and at 2 with deferral 8), bins, aligned steps and token CV as with None on
    all six. Held out (not used to choose), at 2 against None: token CV 0.58% against 1.23%
    at 2048/8K/16 (fixed B 1.08%), 0.93% against 3.54% at 2048/2K/64, 1.40% against 3.75% at
    2048/128K/32, the same bins on all nine. Sweep: no change at 1 or 4."""

    defer_tries: int = 3
    """Deferring the largest examples tries the fewest the token bound allows, then this many
    more counts. Basis: inherited, no measurement of its own. Sweep (deferral 8 at 128/4K/8):
    no change at 1 or 6."""

    repair_budget: int = 8
    """Evictions the fixed-count repacking (``packing.rebin.fit_into_count``, which reads it
    here) may make before it gives up. Basis: inherited, no measurement of its own. Sweep: no
    change at 4 or 16."""

    rebalance_fill_rounds: int = 4
    """With ``rank_assignment: rebalanced``, rounds of the fill (every rank above the mean
    moves examples to the lightest). Basis: ``benchmarks/bench_rank_rebalance.py --sweep``
    (``benchmarks/results/bench_rank_rebalance_sweep.md``, with the retry): 2, 4 and 8 end
    alike on the held-out geometries (mean slowest / mean rank 1.0098); at B 4096 / 128K /
    dp 64, 1.0131 at 2, 1.0104 at 4 and 1.0097 at 8 (before the retry, 4 ended best: 1.0224
    against 1.0295 and 1.0283). The constant sweep: step-time CV moves
    by under 0.01 points at 2 or 8 (bins, aligned steps and token CV never move with it: only
    which rank trains an example changes)."""

    rebalance_evens_per_rank: int = 1
    """With ``rank_assignment: rebalanced``, transfers (moves, swaps, exchanges) of the slowest
    rank after the fill, per rank of the step. Basis: the same sweep: 1.0280 at 0, 1.0098 at
    1, 1.0088 at 2 (planning up to 1.6x slower); at B 4096 / dp 64, 1.3492 at 0, 1.0104 at 1,
    1.0101 at 2. The constant sweep: at 0, step-time CV +0.10 points at 128/4K/8, -0.06 at
    256/16K/8 and +0.03 at 1024/64K/8; at 2, within 0.05."""

    rebalance_partners: int = 3
    """With ``rank_assignment: rebalanced``, the slowest rank is evened with the first of this
    many lightest ranks that can take a transfer. Basis: the rebalance sweep: mean slowest /
    mean rank 1.0110 at 1, 1.0098 at 3, 1.0093 at 6 (at B 4096 / dp 64: 1.0112, 1.0104,
    1.0089; before the retry 1.0871, 1.0224, 1.0098); more partners try more transfers that
    fail before the last, so planning slows (before the retry, at B 4096 / dp 64 about 14.8 ->
    17.0-18.3 ms at 6, CPU time)."""

    rebalance_retry_above: float | None = 0.03
    """With ``rank_assignment: rebalanced``, a step whose slowest rank is still more than this
    fraction of the mean rank above the least any hand-out of its bins could reach
    (`rank_bound.slowest_rank_bound`) is handed out again: whole bins by Karmarkar-Karp over the
    moved bins' costs, then the evening transfers with ``rebalance_retry_partners`` partners,
    kept where the slowest rank is faster (`hand_out.hand_out`); None: one pass. Basis:
    ``benchmarks/bench_rank_retry.py`` (``benchmarks/results/bench_rank_retry.md``, the six
    study geometries and B 4096 / 128K / dp 64): mean slowest / mean rank of this planner, off /
    at 1.5% / 3% / 6%: 1024 / 64K / dp 8 1.0112 / 1.0065 / 1.0081 / 1.0103; 512 / 32K / dp 16
    1.0261 / 1.0217 / 1.0231 / 1.0249; 4096 / dp 64 1.0193 / 1.0058 / 1.0104 / 1.0130 (the other
    four geometries are within 0.0001 of even or of their bound, and retry under 1% of steps).
    The hand-out's added CPU time per step, mean: +0.78 / +0.58 / +0.20 ms at 1024 / dp 8 and
    +4.9 / +0.9 / +0.4 ms at 4096 / dp 64. 3% takes two thirds of 1.5%'s gain at dp 8 and 16 for
    under half its time at dp 64."""

    rebalance_retry_partners: int = 16
    """The lightest ranks the slowest is evened with when a step is handed out again (at most
    dp). Basis: ``benchmarks/bench_rank_retry.py --partners``
    (``benchmarks/results/bench_rank_retry_partners.md``): mean slowest / mean rank of this
    planner with 3 / 8 / 16 / 64 partners: 512 / 32K / dp 16 1.0259 / 1.0255 / 1.0231 / 1.0231;
    4096 / dp 64 1.0159 / 1.0104 / 1.0104 / 1.0095, the retry adding +0.22 / +0.44 / +0.69 /
    +2.16 ms a step there (p99 +3.1 / +7.7 / +8.5 / +22.5 ms); 1024 / dp 8 1.0110 at 3, 1.0081
    at 8 and more. 16 is every rank up to dp 16 and a quarter of the time of every rank at dp
    64."""

    grid_cache_cells: int = 256
    """(boundary x next boundary) grids of at least this many cells are remembered across steps;
    smaller ones are judged anew, cheaper than hashing their key (a pure cache)."""

    range_judge_cells: int = 20_000
    """A (boundary x next boundary) grid of more cells than this is judged by the bound row by
    row, with sorted searches over each row's valid next boundaries, instead of cell by cell
    (the same judgements: a pure speed choice). Measured on the mixed pools at lookahead 6:
    per lookahead pass, cell by cell 0.78 ms against 0.99 at B = 1024 (103^2 cells), 1.31 against
    1.21 at B = 1536, 26 against 1.1 at B = 4096 (409^2 cells)."""

    grids_remembered: int = 12
    """Grids remembered across steps: about two steps' worth at ``lookahead_steps`` = 6 (a
    pure cache)."""

    memo_examples: int = 65_536
    """Packed segments remembered across steps, counted in examples held: about three steps'
    segments of the exact lookahead at B = 128 (a pure cache)."""


DEFAULT_TUNABLES = PlannerTunables()
