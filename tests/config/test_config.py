"""load_config and PackingConfig validation: YAML forms and actionable error messages."""

from __future__ import annotations

import re

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_packing.common.validation import smallest_batch_for
from megatron_packing.config import (
    ConfigError,
    PackingConfig,
    allowed_batch_variation,
    check_batch_window,
    load_config,
)


def write(tmp_path, document, name="train.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(document) if not isinstance(document, str) else document)
    return path


def fails(tmp_path, values, *patterns, dp_size=None, section=True):
    document = {"packing": values} if section else values
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, document), dp_size=dp_size)
    message = str(info.value)
    for pattern in patterns:
        assert re.search(pattern, message), f"{pattern!r} not in {message!r}"
    return message


def test_packing_section_and_flat_form_read_the_same(tmp_path):
    values = {"global_batch_size": 64, "bin_capacity": 2048, "align_packing_bins_to_dp": True,
              "packing_batch_size_allowed_variation": 0.1, "packing_algorithm": "ffd"}
    nested = load_config(write(tmp_path, {"model": {"hidden": 8}, "packing": values}, "a.yaml"))
    flat = load_config(write(tmp_path, values, "b.yaml"), dp_size=8)
    assert nested == flat
    assert nested.global_batch_size == 64 and nested.packing_algorithm == "ffd"
    assert nested.v == 6
    assert load_config(write(tmp_path, "", "empty.yaml")) == PackingConfig()


@pytest.mark.parametrize("batch, variation, v", [(20, 0.1, 2), (1024, 0.05, 51), (128, 0.05, 6),
                                                 (100, 0.07, 7), (10, 0.3, 3)])
def test_allowed_batch_variation_is_the_one_definition_of_v(batch, variation, v):
    assert allowed_batch_variation(batch, variation) == v
    config = PackingConfig(global_batch_size=batch, packing_batch_size_allowed_variation=variation)
    assert config.v == v
    assert check_batch_window(batch, variation, None) == v


@pytest.mark.parametrize("batch", [3, 7, 16, 19, 128, 900])
def test_a_window_of_zero_names_the_smallest_valid_variation(tmp_path, batch):
    message = fails(tmp_path, {"global_batch_size": batch, "align_packing_bins_to_dp": True,
                               "packing_batch_size_allowed_variation": 0.001},
                    "packing_batch_size_allowed_variation=0.001", f"global_batch_size={batch}",
                    "use at least")
    smallest = float(re.search(r"use at least ([0-9.e-]+)", message).group(1))
    assert allowed_batch_variation(batch, smallest) == 1
    load_config(write(tmp_path, {"packing": {
        "global_batch_size": batch, "align_packing_bins_to_dp": True,
        "packing_batch_size_allowed_variation": smallest}}, "ok.yaml"))


def test_batch_minus_window_below_dp_says_how_large_b_must_be(tmp_path):
    values = {"global_batch_size": 10, "align_packing_bins_to_dp": True,
              "packing_batch_size_allowed_variation": 0.2}
    fails(tmp_path, values, "10 - 2 = 8", "data-parallel size 16",
          "global_batch_size to at least 19", dp_size=16)  # 18 - floor(3.6) = 15 < 16
    load_config(write(tmp_path, {"packing": values}, "ok.yaml"), dp_size=8)
    advised = {**values, "global_batch_size": 19}
    load_config(write(tmp_path, {"packing": advised}, "advised.yaml"), dp_size=16)
    fails(tmp_path, {**values, "global_batch_size": 18}, "data-parallel size 16", dp_size=16)


@settings(max_examples=200, deadline=None)
@given(dp=st.integers(1, 512), variation=st.floats(0.001, 0.99), batch=st.integers(1, 600))
def test_following_the_window_advice_passes_and_one_less_fails(dp, variation, batch):
    advised = smallest_batch_for(dp, variation, batch)
    assert advised >= batch
    check_batch_window(advised, variation, dp)
    if advised > batch:
        with pytest.raises(ConfigError):
            check_batch_window(advised - 1, variation, dp)


@pytest.mark.parametrize("variation", [0, 1, -0.1, "abc", True, 1.5])
def test_variation_outside_the_open_unit_interval_is_refused(tmp_path, variation):
    fails(tmp_path, {"packing_batch_size_allowed_variation": variation},
          "packing_batch_size_allowed_variation", r"in \(0, 1\)", re.escape(repr(variation)))


def test_alignment_needs_sequence_packing(tmp_path):
    fails(tmp_path, {"align_packing_bins_to_dp": True, "use_sequence_packing": False},
          "align_packing_bins_to_dp", "use_sequence_packing: true")


def test_capacity_below_the_bin_multiple_names_the_multiple(tmp_path):
    fails(tmp_path, {"bin_capacity": 32, "tp_size": 8, "cp_size": 4},
          "bin_capacity=32", "per-bin alignment multiple 64", "tp=8, cp=4",
          "use a multiple of 64")
    load_config(write(tmp_path, {"bin_capacity": 64, "tp_size": 8, "cp_size": 4}, "ok.yaml"))


def test_unknown_key_suggests_the_nearest(tmp_path):
    fails(tmp_path, {"bin_capcity": 1024}, "unknown packing key 'bin_capcity'",
          "did you mean 'bin_capacity'", "valid keys: .*global_batch_size")
    fails(tmp_path, {"packing_batch_size_allowed_varation": 0.1},
          "did you mean 'packing_batch_size_allowed_variation'", section=False)


@pytest.mark.parametrize("key, value, valid", [
    ("packing_algorithm", "first_fit", "mffd, ffd, bfd"),
    ("oversize_policy", "drop", "error, truncate, own_bin"),
    ("fp8_recipe", "hybrid", "delayed, tensorwise, mxfp8, blockwise"),
    ("base_order", "shuffled", "random, sequential"),
])
def test_unknown_choice_lists_the_valid_ones(tmp_path, key, value, valid):
    fails(tmp_path, {key: value}, key, re.escape(repr(value)), re.escape(valid))


@pytest.mark.parametrize("key, value", [
    ("global_batch_size", 12.5), ("global_batch_size", "64"), ("bin_capacity", 0),
    ("bin_capacity", True), ("tp_size", 1.0), ("max_tokens_per_microbatch", "lots"),
    ("micro_batch_size", 0),
])
def test_sizes_must_be_integers(tmp_path, key, value):
    fails(tmp_path, {key: value}, key, "must be an integer >= ", re.escape(repr(value)))


def test_messages_name_the_file(tmp_path):
    message = fails(tmp_path, {"oversize_policy": "drop"})
    assert message.startswith(str(tmp_path / "train.yaml"))
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="YAML syntax error"):
        load_config(write(tmp_path, "packing: [1, 2", "bad.yaml"))
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n", "list.yaml"))
