"""The fit of ms = a + b T + c sum(s^2) and the compositions calibrate times."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_packing.packing.cost_design import design_compositions
from megatron_packing.packing.cost_fit import FitError, Measured, design_rank, fit_costs


def _timed(a: float, b: float, c: float, compositions, noise=None) -> list[Measured]:
    noise = noise or [0.0] * len(compositions)
    return [Measured(tuple(lengths), (a + b * sum(lengths) + c * sum(s * s for s in lengths))
                     * (1.0 + e)) for lengths, e in zip(compositions, noise, strict=True)]


@settings(max_examples=200, deadline=None)
@given(capacity=st.sampled_from([64, 512, 4096, 8192, 65536]),
       b=st.floats(1e-6, 1e-2), k_share=st.floats(0.1, 4.0), m_share=st.floats(0.01, 4.0),
       noise=st.lists(st.floats(-1e-4, 1e-4), min_size=20, max_size=20))
def test_the_fit_recovers_known_constants_from_noisy_timings(capacity, b, k_share, m_share,
                                                              noise):
    # k and m as shares of the capacity: each term is then a visible part of some composition's
    # time (a term far below the noise cannot be recovered by any fit).
    k, m = k_share * capacity, m_share * capacity
    a, c = m * b, b / k
    compositions = design_compositions(capacity)
    fit = fit_costs(_timed(a, b, c, compositions, noise[:len(compositions)]))
    assert fit.a == pytest.approx(a, rel=0.01)
    assert fit.b == pytest.approx(b, rel=0.01)
    assert fit.c == pytest.approx(c, rel=0.01)
    assert fit.attention_cost_constant == pytest.approx(k, rel=0.02)
    assert fit.microbatch_cost_tokens == pytest.approx(m, rel=0.02)
    assert not fit.negative
    assert abs(fit.worst.relative_error) < 1e-3


def test_a_worked_fit_reports_every_composition_and_the_worst_miss():
    # a = 1 ms, b = 0.001 ms per token, c = 1e-7 ms per squared length: exact timings, then one
    # composition 10% slow.
    compositions = [[1000], [500], [100] * 10, [250] * 4]
    exact = _timed(1.0, 0.001, 1e-7, compositions)
    assert [m.ms for m in exact] == pytest.approx([2.1, 1.525, 2.01, 2.025])
    fit = fit_costs(exact)
    assert (fit.a, fit.b, fit.c) == pytest.approx((1.0, 0.001, 1e-7))
    assert fit.attention_cost_constant == pytest.approx(10_000)
    assert fit.microbatch_cost_tokens == pytest.approx(1_000)
    assert [r.modeled_ms for r in fit.rows] == pytest.approx([m.ms for m in exact])
    design = _timed(1.0, 0.001, 1e-7, design_compositions(1024))
    slow = design[:5] + [Measured(design[5].lengths, design[5].ms * 1.1)] + design[6:]
    assert fit_costs(slow).worst.measured == slow[5]


def test_compositions_that_cannot_separate_the_constants_are_refused():
    # Every row full: the token total never changes, so a and b move together.
    full = [[64], [32, 32], [16] * 4, [8] * 8]
    assert design_rank(_timed(1.0, 0.01, 1e-4, full)) == 2
    with pytest.raises(FitError, match="too few distinct compositions to fit three constants"):
        fit_costs(_timed(1.0, 0.01, 1e-4, full))
    with pytest.raises(FitError, match="4 timed, 1 distinct"):
        fit_costs(_timed(1.0, 0.01, 1e-4, [[64]] * 4))


def test_a_fit_whose_constants_come_out_negative_says_which():
    # Longer single sequences measured faster than shorter ones: attention "costs" below zero.
    measured = [Measured((1000,), 1.0), Measured((500,), 1.6), Measured((100,) * 10, 2.0),
                Measured((250,) * 4, 1.8)]
    fit = fit_costs(measured)
    assert fit.c < 0
    assert any(text.startswith("c = ") for text in fit.negative)


@pytest.mark.parametrize("capacity", [64, 100, 4096, 8192, 131072])
def test_the_design_spans_one_sequence_to_many_full_and_partly_full(capacity):
    design = design_compositions(capacity)
    assert len(design) >= 12 and len({tuple(d) for d in design}) == len(design)
    assert all(d and all(s >= 1 for s in d) and sum(d) <= capacity for d in design)
    assert design[0] == [capacity]
    assert max(len(d) for d in design) >= 32
    totals = {sum(d) for d in design}
    assert capacity in totals and min(totals) <= capacity // 4
    # The first three already fix the three constants, should a time limit stop early.
    assert design_rank(_timed(1.0, 0.01, 1e-4, design[:3])) == 3
    with pytest.raises(ValueError, match="at least 64 tokens"):
        design_compositions(63)


def test_measured_rows_describe_themselves():
    assert Measured((2048,) * 4, 1.0).describe() == "4 x 2048"
    assert Measured((4, 2, 1), 1.0).describe() == "4+2+1"
    assert Measured(tuple(range(1, 9)), 1.0).describe() == "1+2+3+4+5+... (8)"
    assert Measured((3, 4), 1.0).squares == 25.0 and Measured((3, 4), 1.0).tokens == 7
    assert np.isclose(fit_costs(_timed(1.0, 0.01, 1e-4, design_compositions(64))).a, 1.0)
