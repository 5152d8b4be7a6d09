"""Resume that checks what changes the math: sampler states field by field and by mode,
checkpoint discovery without the ``latest`` pointer, damaged manifests, changed settings."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_packing.demo import checkpoint as ckpt
from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler
from megatron_packing.padded.sampler import TokenBudgetBatchSampler
from megatron_packing.stream.base_order import SequentialSampler


def padded_sampler():
    return TokenBudgetBatchSampler(SequentialSampler(range(8)), [5] * 8, 4, 2, dp_rank=0)


def packed_sampler():
    return DPAlignedPackingBatchSampler(SequentialSampler(range(8)), [5] * 8, 4, 2,
                                        bin_capacity=16, allowed_variation=0.25, dp_rank=0)


def saved(make):
    sampler = make()
    next(iter(sampler))
    return sampler.state_dict()


# ---- sampler states -------------------------------------------------------------------------

@pytest.mark.parametrize("make, field, value, expected", [
    (packed_sampler, "step", -1, "step is -1, expected an integer >= 0"),
    (packed_sampler, "step_in_epoch", "3", "step_in_epoch is '3', expected an integer >= 0"),
    (packed_sampler, "carry", [1, -2], "carry is [1, -2], expected a list of integers >= 0"),
    (packed_sampler, "drift", 0.5, "drift is 0.5, expected an integer"),
    (packed_sampler, "order", None, "order is None, expected a dict"),
    (padded_sampler, "step", -1, "step is -1, expected an integer >= 0"),
    (padded_sampler, "max_tokens", 0, "max_tokens is 0, expected an integer >= 1 or None"),
    (padded_sampler, "budget_changes", [[1]], "budget_changes is [[1]], expected a list of"),
])
def test_a_tampered_state_field_is_refused_by_name(make, field, value, expected):
    state = saved(make)
    state[field] = value
    with pytest.raises(ValueError, match="damaged sampler state") as info:
        make().load_state_dict(state)
    assert expected in str(info.value)


def test_a_carry_beyond_the_dataset_is_refused():
    state = saved(packed_sampler)
    state["carry"] = [8]
    with pytest.raises(ValueError, match="carry holds example 8, beyond the dataset's 8"):
        packed_sampler().load_state_dict(state)


@pytest.mark.parametrize("make, other, mode", [(packed_sampler, padded_sampler, "padded"),
                                               (padded_sampler, packed_sampler, "packed")])
def test_a_state_of_the_other_mode_is_named_as_such(make, other, mode):
    with pytest.raises(ValueError, match=rf"got a {mode}-mode state \(saved by "):
        make().load_state_dict(saved(other))


@settings(max_examples=60, deadline=None)
@given(field=st.sampled_from(["step", "step_in_epoch", "deferred"]),
       value=st.one_of(st.integers(max_value=-1), st.floats(allow_nan=False), st.text(max_size=3),
                       st.none(), st.booleans()))
def test_any_impossible_counter_is_refused(field, value):
    state = saved(packed_sampler)
    state[field] = value
    with pytest.raises(ValueError, match=f"{field} is .*expected an integer >= 0"):
        packed_sampler().load_state_dict(state)


@settings(max_examples=30, deadline=None)
@given(steps=st.integers(min_value=0, max_value=6))
def test_every_state_the_sampler_saves_loads(steps):
    for make in (packed_sampler, padded_sampler):
        sampler = make()
        it = iter(sampler)
        for _ in range(steps):
            if next(it, None) is None:  # an epoch of 8 examples is over
                break
        make().load_state_dict(sampler.state_dict())


# ---- checkpoint discovery ---------------------------------------------------------------------

def publish(out, step, *, setup=None):
    """A complete one-rank checkpoint of ``step`` (no process group: world size 1)."""
    ckpt.save_checkpoint(out, step, 0, {"x": step}, keep=10, setup=setup)
    return ckpt.checkpoint_root(out) / ckpt.step_dir_name(step)


def test_without_the_latest_pointer_the_newest_complete_checkpoint_wins(tmp_path):
    for step in (10, 20, 30):
        publish(tmp_path, step)
    (ckpt.checkpoint_root(tmp_path) / ckpt.LATEST).unlink()
    chosen, notes = ckpt.find_resume_checkpoint(tmp_path, 1)
    assert chosen is not None and chosen.name == "step_000030"
    assert "latest is missing; resuming from the newest complete checkpoint" in notes[-1]
    assert "step_000030" in notes[-1]


def test_a_latest_pointer_to_an_older_or_missing_checkpoint_is_overruled(tmp_path):
    for step in (10, 20):
        publish(tmp_path, step)
    marker = ckpt.checkpoint_root(tmp_path) / ckpt.LATEST
    marker.write_text("step_000010\n")
    chosen, notes = ckpt.find_resume_checkpoint(tmp_path, 1)
    assert chosen.name == "step_000020" and "names the older step_000010" in notes[-1]
    marker.write_text("step_000099\n")
    chosen, notes = ckpt.find_resume_checkpoint(tmp_path, 1)
    assert chosen.name == "step_000020" and "step_000099, which does not exist" in notes[-1]


def test_the_latest_pointer_decides_when_it_names_the_newest(tmp_path):
    publish(tmp_path, 10)
    newest = publish(tmp_path, 20)
    assert ckpt.find_resume_checkpoint(tmp_path, 1) == (newest, [])


@pytest.mark.parametrize("text, problem", [
    ("{not json", "manifest.json cannot be read"),
    ('{"step": 3, "files": {}}', "world_size is None, expected int"),
    ('{"step": 3, "world_size": "2", "files": {}}', "world_size is '2', expected int"),
    ('[1, 2]', "it holds a list, not an object"),
    ('{"step": 3, "world_size": 1, "files": {"rank0.pt": {"bytes": 3}}}',
     "files['rank0.pt'] is {'bytes': 3}, expected bytes and sha256"),
])
def test_a_corrupted_manifest_is_a_clear_refusal(tmp_path, text, problem):
    directory = publish(tmp_path, 10)
    (directory / ckpt.MANIFEST).write_text(text)
    with pytest.raises(ckpt.CheckpointError, match="is damaged") as info:
        ckpt.find_resume_checkpoint(tmp_path, 1)
    assert problem in str(info.value)


def test_a_changed_setting_is_refused_by_name(tmp_path):
    directory = publish(tmp_path, 10, setup={"train.lr": 0.01, "model.hidden_size": 32})
    ckpt.check_setup(directory, {"train.lr": 0.01, "model.hidden_size": 32})
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.check_setup(directory, {"train.lr": 0.02, "model.hidden_size": 64})
    message = str(info.value)
    assert "train.lr: saved 0.01, now 0.02" in message
    assert "model.hidden_size: saved 32, now 64" in message
    assert "--overwrite" in message


def test_a_checkpoint_without_a_recorded_setup_is_refused(tmp_path):
    directory = publish(tmp_path, 10)
    manifest = json.loads((directory / ckpt.MANIFEST).read_text())
    assert "setup" not in manifest
    with pytest.raises(ckpt.CheckpointError, match="train.lr: not recorded in the checkpoint"):
        ckpt.check_setup(directory, {"train.lr": 0.01})
