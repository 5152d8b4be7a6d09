"""Reports that cannot mislead: `tune` never ranks first a point that truncates most examples,
and a recommendation that truncates any says so in its own line."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_packing.reports.tuning import MOST_TRUNCATED, TunePoint, recommend

from .run_faults_helpers import run_cli, tiny_config, write_config


def point(capacity, fill, truncated, examples=100, variation=0.1):
    return TunePoint(capacity, variation, 2, token_fill=fill, aligned_fraction=1.0, token_cv=0.1,
                     micro_batches_per_rank=2.0, padding_bins=0, truncated_examples=truncated,
                     examples=examples)


def test_a_point_that_truncates_most_is_not_ranked_first():
    cut_all = point(1, 1.0, 100)
    honest = point(256, 0.8, 0)
    choice = recommend([cut_all, honest], current_capacity=1, current_variation=0.1)
    assert choice.point is honest
    assert any("capacity 1 not ranked: it truncates more than 50%" in r for r in choice.reasons)


def test_when_every_point_truncates_most_nothing_is_recommended():
    choice = recommend([point(1, 1.0, 100), point(2, 1.0, 90)], current_capacity=1,
                       current_variation=0.1)
    assert choice.point is None
    assert "every grid point that ran truncates most of its examples" in choice.reasons[0]


def test_a_recommendation_that_truncates_says_so():
    choice = recommend([point(256, 0.9, 3)], current_capacity=256, current_variation=0.1)
    assert any("truncates 3 of 100 simulated examples" in r for r in choice.reasons)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([16, 64, 256, 1024]), st.floats(0.1, 1.0),
                          st.integers(0, 100)), min_size=1, max_size=8, unique_by=lambda t: t[0]))
def test_the_recommended_point_never_truncates_most(specs):
    points = [point(c, f, t) for c, f, t in specs]
    choice = recommend(points, current_capacity=points[0].bin_capacity, current_variation=0.1)
    if choice.point is None:
        assert all(p.truncated_examples > MOST_TRUNCATED * p.examples for p in points)
    else:
        assert choice.point.truncated_examples <= MOST_TRUNCATED * choice.point.examples


@pytest.mark.slow
def test_tune_with_capacity_1_recommends_nothing(tmp_path):
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path))
    result = run_cli([sys.executable, "-m", "megatron_packing.cli", "tune", "--config",
                      str(config), "--capacities", "1", "--no-plot", "--quiet", "--output-dir",
                      str(tmp_path / "r")], timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Recommendation: none" in result.stdout
    assert "bin_capacity: 1," not in result.stdout
    assert "(most truncated: not ranked)" in result.stdout
