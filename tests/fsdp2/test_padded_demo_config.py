"""The demo trainer's padded-mode and backend settings: accepted, defaulted, refused by name;
the padded block's attention mask (property and worked example)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_packing.config import ConfigError
from megatron_packing.config.training import BACKENDS, training_config_from_dict
from megatron_packing.demo.model import padded_causal_mask
from megatron_packing.demo.trainer import (
    TrainingError,
    _check_padded_lengths,
    model_positions,
)


def _doc(**train) -> dict:
    return {
        "packing": {"global_batch_size": 8, "use_sequence_packing": False,
                    "max_tokens_per_microbatch": 512},
        "data": {"paths": ["x.jsonl"], "tokenizer": "tok"},
        "train": {"dp_size": 2, **train},
    }


class _Lengths:
    def __init__(self, lengths: list[int]) -> None:
        self.lengths = np.asarray(lengths)


def test_backend_defaults_to_megatron_ddp_and_takes_fsdp2():
    assert BACKENDS == ("megatron_ddp", "fsdp2")
    assert training_config_from_dict(_doc()).train.backend == "megatron_ddp"
    assert training_config_from_dict(_doc(backend="fsdp2")).train.backend == "fsdp2"


@pytest.mark.parametrize("value", ["fsdp", "deepspeed", "", 2])
def test_a_bad_backend_is_refused_naming_key_and_choices(value):
    with pytest.raises(ConfigError) as info:
        training_config_from_dict(_doc(backend=value), source="t.yaml")
    assert str(info.value) == (f"t.yaml: train.backend must be one of megatron_ddp, fsdp2; "
                               f"got {value!r}")


def test_padded_mode_is_accepted_with_a_budget_or_a_fixed_micro_batch_size():
    budget = training_config_from_dict(_doc(backend="fsdp2"))
    assert not budget.packing.use_sequence_packing
    doc = _doc()
    doc["packing"] = {"global_batch_size": 8, "use_sequence_packing": False,
                      "micro_batch_size": 2}
    fixed = training_config_from_dict(doc)
    assert fixed.packing.max_tokens_per_microbatch is None and fixed.packing.micro_batch_size == 2


def test_padded_model_positions_follow_the_longest_example_or_the_setting():
    cfg = training_config_from_dict(_doc())
    assert model_positions(cfg, _Lengths([5, 90, 7])) == 90
    doc = _doc()
    doc["model"] = {"max_position_embeddings": 64}
    capped = training_config_from_dict(doc)
    assert model_positions(capped, _Lengths([5, 60])) == 64
    _check_padded_lengths(capped, _Lengths([5, 64]))  # fits exactly
    with pytest.raises(TrainingError) as info:
        _check_padded_lengths(capped, _Lengths([5, 65, 3]))
    assert str(info.value).startswith("example 1 has 65 tokens, more than "
                                      "model.max_position_embeddings (64)")


def test_padded_causal_mask_worked_example():
    mask = padded_causal_mask(torch.tensor([3, 1]), 4)  # True = forbidden
    assert mask.shape == (2, 1, 4, 4)
    allowed = (~mask[:, 0]).int().tolist()
    assert allowed[0] == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert allowed[1] == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]]  # pads: + self


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=5), st.integers(0, 3))
def test_padding_never_reaches_a_real_token_and_no_row_is_empty(lengths, extra):
    width = max(max(lengths), 1) + extra
    allowed = ~padded_causal_mask(torch.tensor(lengths), width)[:, 0]
    for row, n in enumerate(lengths):
        for t in range(width):
            assert allowed[row, t].any()  # a softmax over at least one key
            if t < n:  # a real query sees exactly the real keys up to itself
                expected = [s <= t for s in range(width)]
                assert allowed[row, t].tolist() == expected
