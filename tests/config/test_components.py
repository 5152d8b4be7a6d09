"""The components behind `PackingConfig`: each YAML key sets one field, and that field reaches the
sampler, collator or loader built from the config; bad values are refused under the YAML key."""

from __future__ import annotations

import dataclasses
from dataclasses import fields
from typing import Any

import numpy as np
import pytest
from sampler.synthetic import SyntheticSFT, mixed_lengths
from torch.utils.data import SequentialSampler

from megatron_packing.config import (
    COMPONENTS,
    YAML_KEYS,
    ConfigError,
    LoaderConfig,
    PackerConfig,
    PackingConfig,
    PaddedConfig,
    PlannerConfig,
)
from megatron_packing.config.mode_keys import PACKED_ONLY_KEYS, PADDED_ONLY_KEYS
from megatron_packing.loader.dataloader import WorkerConfig, build_sft_dataloader
from megatron_packing.packed.components import build_packed_components
from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler, PackedSamplerConfig
from megatron_packing.padded.components import build_padded_components
from megatron_packing.padded.sampler import PaddedSamplerConfig, TokenBudgetBatchSampler

DATASET = SyntheticSFT(mixed_lengths(120, seed=1, high=500))
NOT_YAML = {("planner", "max_packs"), ("planner", "tunables"), ("padded", "split_method")}
"""Component fields no YAML key sets (set in code only)."""


# ---------------------------------------------------------------------------- the key table
def test_every_component_field_has_exactly_one_yaml_key_or_none_on_purpose():
    targets = [(row.component, row.field) for row in YAML_KEYS.values()]
    assert len(set(targets)) == len(targets), "two YAML keys set the same field"
    every_field = {(name, f.name) for name, cls in COMPONENTS.items() for f in fields(cls)}
    assert set(targets) <= every_field
    assert every_field - set(targets) == NOT_YAML


def _fields_of(config: PackingConfig) -> dict[tuple[str, str], Any]:
    return {(name, f.name): getattr(getattr(config, name), f.name)
            for name in COMPONENTS for f in fields(COMPONENTS[name])}


# A value other than the default for every key, with the keys it needs to be valid.
NON_DEFAULT: dict[str, tuple[Any, dict[str, Any]]] = {
    "global_batch_size": (40, {}),
    "bin_capacity": (1024, {}),
    "use_sequence_packing": (False, {}),
    "align_packing_bins_to_dp": (True, {}),
    "packing_batch_size_allowed_variation": (0.25, {"align_packing_bins_to_dp": True}),
    "packing_algorithm": ("bfd", {}),
    "oversize_policy": ("truncate", {}),
    "max_tokens_per_microbatch": (3000, {}),
    "micro_batch_size": (3, {}),
    "tp_size": (2, {}),
    "cp_size": (2, {}),
    "fp8_enabled": (True, {}),
    "fp8_recipe": ("mxfp8", {"fp8_enabled": True}),
    "base_order": ("sequential", {}),
    "seed": (7, {}),
    "rank_assignment": ("round_robin", {}),
    "attention_cost_constant": (1000.0, {}),
    "microbatch_cost_tokens": (5000.0, {}),
    "pad_bins_to_capacity": (True, {}),
    "lookahead_steps": (1, {}),
    "max_deferred_examples": (2, {"align_packing_bins_to_dp": True}),
    "pad_token_id": (7, {}),
}
BASE = {"global_batch_size": 24, "bin_capacity": 512, "packing_batch_size_allowed_variation": 0.125}


def test_the_non_default_table_covers_every_key():
    assert set(NON_DEFAULT) == set(YAML_KEYS)


@pytest.mark.parametrize("key", list(YAML_KEYS))
def test_a_key_sets_exactly_its_component_field(key):
    value, context = NON_DEFAULT[key]
    before = PackingConfig(**{**BASE, **context})
    after = PackingConfig(**{**BASE, **context, key: value})
    assert before.to_dict()[key] != value, "the table's value is the default"
    old, new = _fields_of(before), _fields_of(after)
    changed = [target for target in old if old[target] != new[target]]
    assert changed == [(YAML_KEYS[key].component, YAML_KEYS[key].field)]
    assert getattr(after, key) == value and after.to_dict()[key] == value
    assert before.with_keys(**{key: value}) == after


def test_every_key_round_trips_through_the_yaml_mapping():
    values = {**BASE}
    for key, (value, context) in NON_DEFAULT.items():
        if key in ("use_sequence_packing", "fp8_enabled", "fp8_recipe"):
            continue  # they exclude alignment / change the bin multiple: checked below
        values.update(context)
        values[key] = value
    values["bin_capacity"] = 1024  # a multiple of tp x cp x 2
    for extra in ({}, {"fp8_enabled": True, "fp8_recipe": "mxfp8", "bin_capacity": 4096},
                  {"use_sequence_packing": False, "align_packing_bins_to_dp": False,
                   "max_deferred_examples": 0}):
        document = {**values, **extra}
        if document.get("use_sequence_packing", True):  # padded-only keys are refused when packing
            document = {k: v for k, v in document.items() if k not in PADDED_ONLY_KEYS}
        config = PackingConfig.from_dict(document, source="test.yaml")
        assert config.to_dict() == {**PackingConfig().to_dict(), **document}
        assert PackingConfig.from_dict(config.to_dict()) == config


# ---------------------------------------------------------------------------- keys reach the objects
def _built(config: PackingConfig) -> dict[str, Any]:
    sampler, _, collator = build_packed_components(DATASET, config, dp_rank=None, dp_size=2)
    padded, _, padded_collator = build_padded_components(DATASET, config, dp_rank=None, dp_size=2)
    loader = build_sft_dataloader(DATASET, config, dp_rank=0, dp_size=2)
    return {"sampler": sampler, "collator": collator, "padded": padded,
            "padded_collator": padded_collator, "loader": loader}


def _first_step(sampler: Any) -> list[int]:
    return list(next(iter(sampler)))


# What the built objects do with each key, read from their working parts (not their config):
# one entry per object the key must reach.
OBSERVED = {
    "global_batch_size": lambda b: (b["sampler"].batch_size, b["padded"].global_batch_size),
    "bin_capacity": lambda b: (b["sampler"].packer.bin_capacity,),
    "use_sequence_packing": lambda b: (type(b["loader"].batch_sampler).__name__,),
    "align_packing_bins_to_dp": lambda b: (b["sampler"].align_to_dp, b["sampler"].v),
    "packing_batch_size_allowed_variation": lambda b: (b["sampler"].v,),
    "packing_algorithm": lambda b: (type(b["sampler"].packer).__name__,),
    "oversize_policy": lambda b: (str(b["sampler"].packer.oversize_policy.value),),
    "max_tokens_per_microbatch": lambda b: (b["padded"].max_tokens,),
    "micro_batch_size": lambda b: (b["padded"].micro_batch_size,),
    "tp_size": lambda b: (b["sampler"].alignment.bin_multiple, b["sampler"].row_planner.bin_multiple),
    "cp_size": lambda b: (b["sampler"].alignment.seq_multiple, b["sampler"].padded_lengths.tolist()),
    "fp8_enabled": lambda b: (b["sampler"].alignment.bin_multiple, b["sampler"].row_planner.bin_multiple),
    "fp8_recipe": lambda b: (b["sampler"].alignment.bin_multiple, b["sampler"].row_planner.bin_multiple),
    "base_order": lambda b: (_first_step(b["sampler"]), list(next(iter(b["padded"])))),
    "seed": lambda b: (_first_step(b["sampler"]), list(next(iter(b["padded"])))),
    "rank_assignment": lambda b: (b["sampler"].rank_assignment,),
    "attention_cost_constant": lambda b: (b["sampler"].attention_cost_constant,),
    "microbatch_cost_tokens": lambda b: (b["sampler"].microbatch_cost_tokens,),
    "pad_bins_to_capacity": lambda b: ([r.length for r in next(iter(b["sampler"])).plan.layouts],),
    "lookahead_steps": lambda b: (b["sampler"].sizer.horizon,),
    "max_deferred_examples": lambda b: (b["sampler"].sizer.max_deferred,),
    "pad_token_id": lambda b: (b["collator"].pad_token_id, b["padded_collator"].pad_token_id),
}


def test_every_key_has_an_observation():
    assert set(OBSERVED) == set(YAML_KEYS)


@pytest.mark.parametrize("key", list(YAML_KEYS))
def test_each_key_reaches_what_the_loader_builds(key):
    """Set one key to a non-default value: the sampler, collator or loader built must see it."""
    value, context = NON_DEFAULT[key]
    observe = OBSERVED[key]
    before = observe(_built(PackingConfig(**{**BASE, **context})))
    after = observe(_built(PackingConfig(**{**BASE, **context, key: value})))
    unchanged = [number for number, (a, b) in enumerate(zip(before, after, strict=True)) if a == b]
    assert not unchanged, f"{key}={value!r} did not reach built object(s) {unchanged}"


# ---------------------------------------------------------------------------- bad values
def _component_of(key: str) -> tuple[type, dict[str, Any]]:
    component = YAML_KEYS[key].component
    required = {"packer": {"bin_capacity": 512}, "planner": {"batch_size": 24}}
    return COMPONENTS[component], required.get(component, {})


@pytest.mark.parametrize("key", list(YAML_KEYS))
def test_a_component_refuses_a_bad_value_under_the_yaml_key(key):
    """A string where a number, flag or known choice belongs: the message leads with the key."""
    cls, required = _component_of(key)
    field = YAML_KEYS[key].field
    with pytest.raises(ConfigError) as info:
        cls(**{**required, field: "bogus"})
    assert str(info.value).startswith(f"{key} must be "), str(info.value)
    assert "'bogus'" in str(info.value)
    with pytest.raises(ConfigError, match=rf"^test\.yaml: {key} must be .*'bogus'"):
        PackingConfig.from_dict({key: "bogus"}, source="test.yaml")


@pytest.mark.parametrize("make, message", [
    (lambda: PlannerConfig(batch_size=0), "global_batch_size must be an integer >= 1, got 0"),
    (lambda: PlannerConfig(batch_size=np.int64(8), allowed_variation=1.0),
     r"packing_batch_size_allowed_variation must be a number in \(0, 1\), got 1.0"),
    (lambda: PlannerConfig(batch_size=10), r"packing_batch_size_allowed_variation=0.05 gives a window"),
    (lambda: PlannerConfig(batch_size=10, align_to_dp=False, max_deferred_examples=1),
     "max_deferred_examples=1 needs align_packing_bins_to_dp: true"),
    (lambda: PlannerConfig(batch_size=10, allowed_variation=0.2, max_deferred_examples=8),
     "below the smallest step size B - v = 8"),
    (lambda: PlannerConfig(batch_size=10, allowed_variation=0.2, max_packs=0),
     "max_packs must be an integer >= 1, got 0"),
    (lambda: PackerConfig(bin_capacity=16, tp_size=4, cp_size=4),
     "bin_capacity=16 is smaller than the per-bin alignment multiple 32"),
    (lambda: PackerConfig(bin_capacity=64, fp8_recipe="mxfp8"),
     "fp8_recipe='mxfp8' is set but fp8_enabled is False"),
    (lambda: PaddedConfig(split_method="evenly"), "split_method must be one of greedy, balanced"),
    (lambda: LoaderConfig(seed=-1), "seed must be an integer >= 0, got -1"),
    (lambda: WorkerConfig(num_workers=-1), "num_workers must be an integer >= 0, got -1"),
    (lambda: PaddedSamplerConfig(global_batch_size=8, dp_size=0), "dp_size must be an integer >= 1"),
    (lambda: PackingConfig(use_sequence_packing=False, align_packing_bins_to_dp=True),
     "align_packing_bins_to_dp: true needs use_sequence_packing: true"),
    (lambda: PackingConfig(bin_capacity=1023, tp_size=2, pad_bins_to_capacity=True),
     r"pad_bins_to_capacity: true pads every row to bin_capacity=1023 .* e.g. 1022"),
])
def test_components_refuse_bad_values_and_combinations(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_components_normalise_numpy_values_and_are_frozen():
    planner = PlannerConfig(batch_size=np.int64(24), allowed_variation=np.float32(0.125))
    assert type(planner.batch_size) is int and planner.v == 3
    config = PackingConfig(planner=planner)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.planner = planner  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        planner.batch_size = 3  # type: ignore[misc]
    assert config.global_batch_size == 24 and config.with_keys(seed=5).seed == 5
    with pytest.raises(ConfigError, match="global_batch_size must be"):
        config.with_keys(global_batch_size=0)


def test_the_constructor_refuses_an_unknown_key_with_a_suggestion():
    with pytest.raises(TypeError, match="unknown packing key 'bin_capcity'; did you mean 'bin_capacity'"):
        PackingConfig(bin_capcity=512)
    with pytest.raises(TypeError, match="planner must be a PlannerConfig, got PackerConfig"):
        PackingConfig(planner=PackerConfig(bin_capacity=64))


# ---------------------------------------------------------------------------- one way to build
LENGTHS = mixed_lengths(60, seed=2, high=300)


def test_a_samplers_config_builds_it_through_its_one_constructor():
    """`PackedSamplerConfig.build` calls the keyword constructor with the config's settings: the
    sampler it builds has the same config, fingerprint and plans as the keyword form's."""
    keywords = dict(bin_capacity=512, allowed_variation=0.25, tp_size=2, lookahead_steps=2,
                    rank_assignment="round_robin", max_deferred_examples=1, seed=3)
    by_keywords = DPAlignedPackingBatchSampler(SequentialSampler(range(60)), LENGTHS, 8, 2,
                                               **keywords)
    config = PackedSamplerConfig(
        packer=PackerConfig(bin_capacity=512, tp_size=2),
        planner=PlannerConfig(batch_size=8, allowed_variation=0.25, lookahead_steps=2,
                              rank_assignment="round_robin", max_deferred_examples=1),
        dp_size=2, seed=3)
    by_config = config.build(SequentialSampler(range(60)), LENGTHS)
    assert by_keywords.config == config == by_config.config
    assert by_keywords.state_dict()["fingerprint"] == by_config.state_dict()["fingerprint"]
    assert [b.plan.bins for b in by_keywords] == [b.plan.bins for b in by_config]
    padded = PaddedSamplerConfig(global_batch_size=8, dp_size=2,
                                 padded=PaddedConfig(max_tokens_per_microbatch=600), seed=4)
    built = padded.build(SequentialSampler(range(60)), LENGTHS, dp_rank=1)
    assert built.config == padded and built.dp_rank == 1


@pytest.mark.parametrize("make", [
    lambda: DPAlignedPackingBatchSampler(SequentialSampler(range(60)), LENGTHS, 8, 2,
                                         bin_capacity=512, allowed_variation=0.25, bin_capcity=1),
    lambda: TokenBudgetBatchSampler(SequentialSampler(range(60)), LENGTHS, 8, 2, bin_capcity=1),
])
def test_a_keyword_form_refuses_an_unknown_keyword_naming_the_valid_ones(make):
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'bin_capcity'; valid: "):
        make()


def test_the_keyword_form_names_the_valid_keywords_and_what_is_missing():
    with pytest.raises(TypeError, match="valid: bin_capacity, algorithm, .*batch_size, "
                                        "allowed_variation, .*seed, eval_mode"):
        DPAlignedPackingBatchSampler(SequentialSampler(range(60)), LENGTHS, 8, 2, bin_capacity=512,
                                     capacity=512)
    with pytest.raises(TypeError, match="needs the keyword argument 'bin_capacity'"):
        DPAlignedPackingBatchSampler(SequentialSampler(range(60)), LENGTHS, 8, 2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bin_capcity'"):
        build_sft_dataloader(DATASET, PackingConfig(), dp_rank=0, dp_size=2,
                             bin_capcity=1)  # type: ignore[call-arg]


def test_each_key_reads_in_the_mode_its_row_names():
    assert set(PADDED_ONLY_KEYS) == {"max_tokens_per_microbatch", "micro_batch_size"}
    assert "bin_capacity" in PACKED_ONLY_KEYS and "seed" not in PACKED_ONLY_KEYS
    assert all(YAML_KEYS[key].mode == "packed" for key in PACKED_ONLY_KEYS)


def test_the_readmes_key_table_is_generated_from_the_config():
    from megatron_packing.reports import key_table

    readme = key_table.README.read_text()
    assert key_table.replace_table(readme, key_table.render()) == readme, (
        "README.md's config-key table is stale: run "
        "`python -m megatron_packing.reports.key_table --write-docs`")


def test_the_key_table_shows_each_rows_default_and_meaning(monkeypatch):
    from megatron_packing.config import components
    from megatron_packing.reports import key_table

    assert "| `lookahead_steps` | 6 | steps planned together" in key_table.render()
    row = YAML_KEYS["seed"]
    monkeypatch.setitem(components.YAML_KEYS, "seed", row._replace(meaning="a new meaning"))
    assert "| `seed` | 1234 | a new meaning |" in key_table.render()
