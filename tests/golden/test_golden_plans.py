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
    "128/4K/dp8": "b63189b0cdd787f62fe17be1eb9abc1c",
    "128/4K/dp8 deferral": "8d0b1f41d53720a4b501ff70adba389f",
    "256/16K/dp4 ffd": "1055b87123d21a49395a8000c350df3e",
    "64/8K/dp4 bfd tp2 cp2": "1ee6f5aae6a920131470fabfe1fc3390",
    "96/4K/dp2 round robin": "ef3141494d061bdc7d21b77c14f88759",
    "128/4K/dp8 fixed B": "a9bf4b5c100e3236f466f2fb552ffb50",
    "128/4K/dp8 whole bins": "92a127e8d9f13da16af44756bb8b5009",
    "1024/64K/dp8": "eb003bc3d0106d5f4c128ecfd7be2978",
    "padded 64/dp4 budget 16K": "7c7231dd8fc42dc5705151cfe2ce54d0",
    "padded 48/dp2 mbs 4": "48f6830e58ae5934d65362badecde238",
    "config 64/8K/dp4 seed 99": "9b942bfb07dc6fd5c5202618147bdf9f",
}


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
