"""The plans on the shipped pools are the same, bit for bit, as before the code moved.

Any change to what trains where (a batch boundary, a bin, a rank's share, a deferred example, a
padded schedule) changes a digest; `plan_digests.py` says how to print the current ones after a
deliberate planner change.
"""

from __future__ import annotations

import dataclasses

import pytest

from .plan_digests import (
    CONFIG_GEOMETRIES,
    PACKED_GEOMETRIES,
    PADDED_GEOMETRIES,
    config_path_digest,
    packed_digest,
    padded_digest,
)

EXPECTED = {
    "128/4K/dp8": "df1410c0e2df4ce0e8b80b6b0c4153fe",
    "128/4K/dp8 deferral": "a2ee78333ada0106f09585db3de8dfc7",
    "256/16K/dp4 ffd": "28b4f326a965e6682c32123d91351775",
    "64/8K/dp4 bfd tp2 cp2": "1653fb0baa93d4dc4c359e7c0c852482",
    "96/4K/dp2 round robin": "ef3141494d061bdc7d21b77c14f88759",
    "128/4K/dp8 fixed B": "70e983e1745b91198f16e622f02efb0d",
    "128/4K/dp8 whole bins": "92a127e8d9f13da16af44756bb8b5009",
    "1024/64K/dp8": "a60fc5d695d442225b1af177ab318f41",
    "padded 64/dp4 budget 16K": "7c7231dd8fc42dc5705151cfe2ce54d0",
    "padded 48/dp2 mbs 4": "48f6830e58ae5934d65362badecde238",
    "config 64/8K/dp4 seed 99": "43c3a942fc58757928fa58e066c6be31",
}


# What each step takes, not where it goes: unchanged since the hand-out to ranks (which example
# in which bin of which rank, the only part of the digests above it decides) last changed,
# when the one-neighbour transfer search replaced a two-neighbour one
# (benchmarks/results/bench_hand_out_budget.md: at most 0.03% of modeled run time held out).
STEPS_EXPECTED = {
    "128/4K/dp8": "ff5d759cd35aae46eb700c3ab7089e96",
    "128/4K/dp8 deferral": "37fc9187524cb1ab314c8381aa5fb4f0",
    "256/16K/dp4 ffd": "be667af6e411f3884038ed6f2ec0d400",
    "64/8K/dp4 bfd tp2 cp2": "513ffe242789c8b4f03c573f31242db8",
    "96/4K/dp2 round robin": "b15e4af244f22d11d8c8f2027ab48329",
    "128/4K/dp8 fixed B": "7df525414f17d034d09ef5416112b758",
    "128/4K/dp8 whole bins": "ff5d759cd35aae46eb700c3ab7089e96",
    "1024/64K/dp8": "28158afd13b90b7b77086537ed97ab11",
}


@pytest.mark.parametrize("name,batch,capacity,dp,steps,options", PACKED_GEOMETRIES,
                         ids=[g[0] for g in PACKED_GEOMETRIES])
def test_what_each_step_takes_is_unchanged(name, batch, capacity, dp, steps, options):
    assert packed_digest(batch, capacity, dp, steps, options, hand_out=False) == \
        STEPS_EXPECTED[name]


@pytest.mark.parametrize("name,batch,capacity,dp,steps,options", PACKED_GEOMETRIES,
                         ids=[g[0] for g in PACKED_GEOMETRIES])
def test_packed_plans_are_unchanged(name, batch, capacity, dp, steps, options):
    assert packed_digest(batch, capacity, dp, steps, options) == EXPECTED[name]


@pytest.mark.parametrize("name,batch,dp,steps,budget,mbs", PADDED_GEOMETRIES,
                         ids=[g[0] for g in PADDED_GEOMETRIES])
def test_padded_schedules_are_unchanged(name, batch, dp, steps, budget, mbs):
    assert padded_digest(batch, dp, steps, budget, mbs) == EXPECTED[name]


@pytest.mark.parametrize("name,steps,keys", CONFIG_GEOMETRIES, ids=[g[0] for g in CONFIG_GEOMETRIES])
def test_plans_built_from_a_config_are_unchanged(name, steps, keys):
    assert config_path_digest(steps, keys) == EXPECTED[name]


def test_the_digests_see_a_planner_change(monkeypatch):
    """A planner that misreads the drift by one example changes the digest: the test can fail."""
    from megatron_packing.packing.planner.sizer import StepSizer

    original = StepSizer.decide

    def off_by_one(self, lengths, aligned, context, **options):
        return original(self, lengths, aligned, dataclasses.replace(context, drift=context.drift + 1),
                        **options)

    monkeypatch.setattr(StepSizer, "decide", off_by_one)
    name, batch, capacity, dp, steps, options = PACKED_GEOMETRIES[0]
    assert packed_digest(batch, capacity, dp, steps, options) != EXPECTED[name]
