"""One enum per choice: validation and the command line read the same values."""

from __future__ import annotations

import pytest

from megatron_packing.cli import main
from megatron_packing.config import ConfigError
from megatron_packing.config.components import (
    BASE_ORDERS,
    BaseOrder,
    PackerConfig,
    PaddedConfig,
    PlannerConfig,
)
from megatron_packing.packing.algorithms import OversizePolicy, PackingAlgorithm
from megatron_packing.packing.alignment import FP8_RECIPES, Fp8Recipe
from megatron_packing.packing.balance import RankAssignment
from megatron_packing.packing.microbatch import SPLIT_METHODS, SplitMethod
from megatron_packing.packing.packer_config import OVERSIZE_POLICIES, PACKING_ALGORITHMS
from megatron_packing.packing.planner.config import RANK_ASSIGNMENTS


@pytest.mark.parametrize("values, enum", [
    (PACKING_ALGORITHMS, PackingAlgorithm), (OVERSIZE_POLICIES, OversizePolicy),
    (BASE_ORDERS, BaseOrder), (RANK_ASSIGNMENTS, RankAssignment), (SPLIT_METHODS, SplitMethod),
    (FP8_RECIPES, Fp8Recipe),
])
def test_each_choice_list_is_its_enums_values(values, enum):
    assert values == tuple(member.value for member in enum)


@pytest.mark.parametrize("build", [
    lambda value: PackerConfig(bin_capacity=64, algorithm=value),
    lambda value: PlannerConfig(batch_size=64, rank_assignment=value),
    lambda value: PaddedConfig(split_method=value),
], ids=["algorithm", "rank_assignment", "split_method"])
def test_a_value_outside_the_enum_is_refused(build):
    with pytest.raises(ConfigError, match="must be one of"):
        build("nearest")


def test_members_and_their_values_build_the_same_config():
    assert PackerConfig(bin_capacity=64, algorithm=PackingAlgorithm.BFD) == PackerConfig(
        bin_capacity=64, algorithm="bfd")
    assert type(PackerConfig(bin_capacity=64, algorithm=PackingAlgorithm.BFD).algorithm) is str


def test_the_simulate_command_offers_exactly_the_enums_algorithms(capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "--algorithm", "nearest"])
    message = capsys.readouterr().err
    assert "choose from " + ", ".join(repr(a.value) for a in PackingAlgorithm) in message
