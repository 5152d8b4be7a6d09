"""Data whose meaning would be dropped: per-message weights, broken tool-call arguments, examples
with no next-token target (every source kind), a dataset without any loss token."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from data.sft_test_data import make_tokenizer as make_shared_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_packing.config import PackingConfig
from megatron_packing.data import BadRecordError, load_sft_dataset, save_pretokenized
from megatron_packing.data.records import record_to_messages
from megatron_packing.data.store import StoreWriter
from megatron_packing.loader.dataloader import build_sft_dataloader

from .test_data_faults import TEXT, TOOL_TEMPLATE

TAGS = TOOL_TEMPLATE
# the same ChatML turns without generation tags: masks come from rendered prefixes
PREFIX = TOOL_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")


@pytest.fixture(scope="module", params=["tags", "prefix"])
def tok(request):
    return make_shared_tokenizer(TAGS if request.param == "tags" else PREFIX, vocab_size=320,
                                 corpus=TEXT)


def write(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def load(path, tokenizer, cache, **kw):
    return load_sft_dataset(path, tokenizer, cache_dir=cache, show_progress=False, **kw)


def turns(*weights):
    messages = []
    for k, weight in enumerate(weights):
        messages.append({"role": "user", "content": f"What is {k} + 30?"})
        answer = {"role": "assistant", "content": f"The answer is {k + 30}."}
        if weight is not None:
            answer["weight"] = weight
        messages.append(answer)
    return {"messages": messages}


def trained_text(tokenizer, example) -> str:
    return tokenizer.decode(example["input_ids"][example["loss_mask"] == 1])


# ---- per-message weight -------------------------------------------------------------------

def test_a_weight_zero_turn_gets_no_loss(tok, tmp_path):
    ds = load(write(tmp_path / "w.jsonl", [turns(0, 1), turns(None, None)]), tok, tmp_path / "c")
    assert trained_text(tok, ds[0]) == "The answer is 31.<|im_end|>\n"
    assert trained_text(tok, ds[1]) == ("The answer is 30.<|im_end|>\nThe answer is 31."
                                        "<|im_end|>\n")
    assert ds[0]["input_ids"].tolist() == ds[1]["input_ids"].tolist()  # rendered all the same


def test_every_turn_weight_zero_is_no_loss_tokens(tok, tmp_path):
    path = write(tmp_path / "w.jsonl", [turns(0, 0)])
    with pytest.raises(BadRecordError, match=r"w.jsonl:1: bad record \(no_loss_tokens\)"):
        load(path, tok, tmp_path / "c")
    ds = load(write(tmp_path / "s.jsonl", [turns(0, 0), turns(1)]), tok, tmp_path / "c",
              on_bad_record="skip")
    assert len(ds) == 1 and ds.skipped == {"no_loss_tokens": 1}


def test_last_assistant_turn_with_weight_zero_trains_nothing(tok, tmp_path):
    with pytest.raises(BadRecordError, match="no_loss_tokens"):
        load(write(tmp_path / "w.jsonl", [turns(1, 0)]), tok, tmp_path / "c",
             loss_on="last_assistant_turn")
    ds = load(write(tmp_path / "v.jsonl", [turns(0, 1)]), tok, tmp_path / "c",
              loss_on="last_assistant_turn")
    assert trained_text(tok, ds[0]) == "The answer is 31.<|im_end|>\n"


def test_weight_zero_with_loss_on_all_is_refused(tok, tmp_path):
    with pytest.raises(BadRecordError, match=r"weight_unsupported.*loss_on='all' trains every"):
        load(write(tmp_path / "w.jsonl", [turns(0, 1)]), tok, tmp_path / "c", loss_on="all")


@pytest.mark.parametrize("weight", [0.5, 2, -1, "0", True, None])
def test_a_weight_other_than_0_or_1_is_a_bad_record(weight):
    record = turns(1)
    record["messages"][1]["weight"] = weight
    with pytest.raises(Exception, match=r"invalid_field: message 1 \(assistant\) weight is"):
        record_to_messages(record)


def test_a_weight_on_a_user_message_is_a_bad_record():
    record = turns(1)
    record["messages"][0]["weight"] = 0
    with pytest.raises(Exception, match=r"message 0 \(user\) has a weight"):
        record_to_messages(record)


@settings(max_examples=25, deadline=None)
@given(weights=st.lists(st.sampled_from([0, 1, None]), min_size=1, max_size=4))
def test_trained_turns_are_exactly_those_not_weighted_zero(tmp_path_factory, weights):
    tokenizer = _tags_tokenizer()
    tmp = tmp_path_factory.mktemp("w")
    trained = [k for k, w in enumerate(weights) if w != 0]
    path = write(tmp / "w.jsonl", [turns(*weights)])
    if not trained:
        with pytest.raises(BadRecordError, match="no_loss_tokens"):
            load(path, tokenizer, tmp / "c")
        return
    ds = load(path, tokenizer, tmp / "c")
    assert trained_text(tokenizer, ds[0]) == "".join(f"The answer is {k + 30}.<|im_end|>\n"
                                                     for k in trained)


_TAGS_TOKENIZER: list = []


def _tags_tokenizer():
    if not _TAGS_TOKENIZER:
        _TAGS_TOKENIZER.append(make_shared_tokenizer(TAGS, vocab_size=320, corpus=TEXT))
    return _TAGS_TOKENIZER[0]


# ---- tool-call arguments --------------------------------------------------------------------

@pytest.mark.parametrize("arguments, message", [
    ('{"a": 1,', "arguments is not valid JSON"),
    ("not json", "arguments is not valid JSON"),
    ("[1, 2]", "arguments must hold a JSON object, got list"),
])
def test_broken_tool_call_arguments_are_a_bad_record(tmp_path, arguments, message):
    record = {"messages": [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": arguments}}]},
    ]}
    with pytest.raises(Exception, match=rf"invalid_field: .*function 'add': {message}"):
        record_to_messages(record)


# ---- no next-token target, every source kind -------------------------------------------------

class DuckDataset:
    """A map-style dataset of plain dicts (no length index)."""

    def __init__(self, examples):
        self.examples = examples

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


def _example(n, loss_from=1):
    mask = np.zeros(n, dtype=np.uint8)
    mask[loss_from:] = 1
    return {"input_ids": np.arange(1, n + 1, dtype=np.int64), "loss_mask": mask}


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("bad", [_example(1), _example(5, loss_from=5),
                                 {"input_ids": np.array([7])}], ids=["one_token", "mask_zero",
                                                                     "one_token_no_mask"])
def test_a_duck_typed_example_without_target_is_refused(packed, bad):
    ds = DuckDataset([_example(6) for _ in range(7)] + [bad])
    config = PackingConfig(global_batch_size=4, bin_capacity=64, use_sequence_packing=packed)
    with pytest.raises(ValueError, match=r"1 of 8 examples have no next-token target: example 7"):
        build_sft_dataloader(ds, config, dp_rank=0, dp_size=1)


def test_a_dataset_without_any_loss_token_is_refused_before_planning():
    ds = DuckDataset([_example(4, loss_from=4) for _ in range(4)])
    with pytest.raises(ValueError, match="the loss divisor would be 0"):
        build_sft_dataloader(ds, PackingConfig(global_batch_size=2, bin_capacity=64),
                             dp_rank=0, dp_size=1)


class HFLike(DuckDataset):
    """Duck-typed datasets.Dataset rows (column_names, iteration) for load_sft_dataset."""

    column_names = ["messages"]

    def __iter__(self):
        return iter(self.examples)


def test_a_dataset_row_without_target_follows_on_bad_record(tmp_path):
    tokenizer = _tags_tokenizer()
    rows = HFLike([turns(1), turns(0), turns(1, 1)])
    with pytest.raises(BadRecordError, match=r"row:2: bad record \(no_loss_tokens\)"):
        load_sft_dataset(rows, tokenizer, cache_dir=tmp_path / "c", show_progress=False)
    ds = load_sft_dataset(rows, tokenizer, cache_dir=tmp_path / "c", show_progress=False,
                          on_bad_record="skip")
    assert len(ds) == 2 and ds.skipped == {"no_loss_tokens": 1}


def _store_with_a_row_without_target(tmp_path, tokenizer):
    ds = load(write(tmp_path / "ok.jsonl", [turns(1), turns(1, 1)]), tokenizer, tmp_path / "c")
    good = save_pretokenized(ds, tmp_path / "good")
    writer = StoreWriter(tmp_path / "bad")
    examples = [ds[0], {"input_ids": np.array([5], dtype=np.int32),
                        "loss_mask": np.array([1], dtype=np.uint8)}, ds[1]]
    writer.append(np.concatenate([e["input_ids"] for e in examples]).astype(np.int32),
                  np.concatenate([e["loss_mask"] for e in examples]),
                  np.array([len(e["input_ids"]) for e in examples], dtype=np.int64),
                  np.arange(1, 4))
    meta = json.loads((good / "meta.json").read_text())
    writer.commit({k: meta[k] for k in ("kind", "source", "tokenizer_fingerprint", "loss_on",
                                        "max_length", "truncate")}
                  | {"key": "bad-store", "skipped": {}, "skipped_examples": []})
    return tmp_path / "bad"


def test_a_pretokenized_row_without_target_follows_on_bad_record(tmp_path):
    tokenizer = _tags_tokenizer()
    bad = _store_with_a_row_without_target(tmp_path, tokenizer)
    with pytest.raises(BadRecordError, match=r"bad:2: bad record \(no_loss_tokens\): "
                                             r"pre-tokenized example 1 has 1 token"):
        load_sft_dataset(bad, None, show_progress=False)
    ds = load_sft_dataset(bad, None, show_progress=False, on_bad_record="skip")
    assert len(ds) == 2 and ds.skipped == {"no_loss_tokens": 1}
    assert all(int(c) > 0 for c in ds.loss_token_counts)
