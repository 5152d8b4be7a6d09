"""The tuning grid and the recommendation rule, on hand-made figures."""

from __future__ import annotations

from megatron_packing.reports.tuning import TunePoint, capacity_grid, make_grid, recommend


def point(capacity: int, variation: float, fill: float, *, aligned: float = 0.9, cut: int = 0,
          problem: str | None = None) -> TunePoint:
    return TunePoint(capacity, variation, int(128 * variation), token_fill=fill,
                     aligned_fraction=aligned, token_cv=0.1, micro_batches_per_rank=4.0,
                     padding_bins=0, truncated_examples=cut, batch_size_min=120,
                     batch_size_max=136, problem=problem)


def pick(points, capacity=4096, variation=0.05):
    return recommend(points, current_capacity=capacity, current_variation=variation)


def test_the_best_fill_wins_when_the_others_are_clearly_below():
    best = point(4096, 0.1, 0.97)
    chosen = pick([point(4096, 0.05, 0.95), best, point(4096, 0.2, 0.96)])
    assert chosen.point is best
    assert chosen.reasons[0].startswith("fill 97.00% of every micro-batch's token slots")


def test_within_the_tolerance_the_current_capacity_beats_a_slightly_better_larger_one():
    current = point(4096, 0.05, 0.950)
    chosen = pick([current, point(8192, 0.05, 0.954), point(2048, 0.05, 0.90)])
    assert chosen.point is current
    assert any("keeps bin_capacity 4096" in r for r in chosen.reasons)
    # the capacity is kept before the variation is narrowed
    wider_here = point(4096, 0.1, 0.952)
    assert pick([wider_here, point(8192, 0.02, 0.953)]).point is wider_here
    # beyond the tolerance the larger capacity is recommended, and the reasons say so
    larger = point(8192, 0.05, 0.96)
    chosen = pick([current, larger])
    assert chosen.point is larger
    assert any("bin_capacity 4096 -> 8192 (more memory per micro-batch" in r for r in chosen.reasons)


def test_within_the_tolerance_the_smallest_variation_wins_at_one_capacity():
    small = point(4096, 0.02, 0.951)
    chosen = pick([point(4096, 0.2, 0.953), small, point(4096, 0.1, 0.955)])
    assert chosen.point is small
    assert any("0.1, 0.2 fill within the tolerance" in r for r in chosen.reasons)


def test_points_that_truncate_more_than_the_current_setting_are_set_aside():
    current = point(4096, 0.05, 0.93, cut=2)
    chosen = pick([current, point(2048, 0.05, 0.99, cut=40), point(8192, 0.05, 0.90, cut=0)])
    assert chosen.point is current  # truncating fewer is allowed, not sought
    assert any("capacity 2048 set aside" in r for r in chosen.reasons)


def test_points_that_did_not_run_are_never_recommended():
    chosen = pick([point(4096, 0.01, 0.0, problem="v = 0: no window"), point(4096, 0.05, 0.9)])
    assert chosen.point.variation == 0.05
    none = pick([point(4096, 0.01, 0.0, problem="v = 0: no window")])
    assert none.point is None and "v = 0: no window" in none.reasons[0]


def test_the_grid_marks_points_that_cannot_run_and_rounds_capacities_to_the_bin_multiple():
    grid = {(g.bin_capacity, g.variation): g.problem
            for g in make_grid([256], [0.01, 0.05, 0.5], batch_size=32, dp_size=24)}
    assert grid[(256, 0.01)] == "v = floor(32 x 0.01) = 0: no window"
    assert grid[(256, 0.05)] is None
    assert grid[(256, 0.5)] == "B - v = 16 < dp = 24"
    assert capacity_grid(1000, bin_multiple=64) == [448, 960, 1000, 1984]
