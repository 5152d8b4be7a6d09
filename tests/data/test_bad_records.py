"""Every bad-record case: a clear error by default, counted skips with on_bad_record='skip'."""

from __future__ import annotations

import json
import logging

import pytest
from sft_test_data import CONVERSATIONS, write_jsonl

from megatron_packing.data import REASONS, BadRecordError, load_sft_dataset

GOOD = {"messages": CONVERSATIONS[0]}

# (case id, raw JSONL line, reason)
CASES = [
    ("malformed_json", '{"messages": [', "malformed_json"),
    ("not_an_object", "[1, 2]", "not_an_object"),
    ("no_known_fields", json.dumps({"text": "hi"}), "missing_field"),
    ("instruction_without_output", json.dumps({"instruction": "hi"}), "missing_field"),
    ("prompt_without_response", json.dumps({"prompt": "hi"}), "missing_field"),
    ("message_without_content", json.dumps({"messages": [{"role": "user"}]}), "missing_field"),
    ("messages_not_list", json.dumps({"messages": "hi"}), "invalid_field"),
    ("message_not_object", json.dumps({"messages": ["hi"]}), "invalid_field"),
    ("empty_conversation", json.dumps({"messages": []}), "empty_conversation"),
    (
        "non_string_content",
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": 3}]}),
        "non_string_content",
    ),
    ("non_string_output", json.dumps({"instruction": "a", "output": ["b"]}), "non_string_content"),
    (
        "unknown_role",
        json.dumps({"messages": [{"role": "robot", "content": "a"}, {"role": "assistant", "content": "b"}]}),
        "unknown_role",
    ),
    ("no_assistant_turn", json.dumps({"messages": [{"role": "user", "content": "a"}]}), "no_assistant_turn"),
    (
        "empty_assistant_content",
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": " "}]}),
        "empty_assistant_turn",
    ),
    ("empty_output", json.dumps({"instruction": "a", "output": ""}), "empty_assistant_turn"),
    (
        "null_content_without_tool_calls",
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None}]}),
        "non_string_content",
    ),
    (
        "tool_calls_template_cannot_render",
        json.dumps({"messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": "{}"}}]},
        ]}),
        "tools_unsupported",
    ),
]


def _file(tmp_path, bad_line):
    # line 1 good, line 2 good, line 3 bad, line 4 good
    return write_jsonl(tmp_path / "d.jsonl", [GOOD, GOOD, GOOD, GOOD], raw_lines={2: bad_line})


@pytest.mark.parametrize(("case", "line", "reason"), CASES, ids=[c[0] for c in CASES])
def test_bad_record_error_mode(case, line, reason, tok, tmp_path):
    path = _file(tmp_path, line)
    with pytest.raises(BadRecordError) as info:
        load_sft_dataset(path, tok, cache_dir=tmp_path / "c", show_progress=False)
    err = info.value
    assert isinstance(err, ValueError)
    assert (err.source, err.line, err.reason) == (str(path), 3, reason)
    msg = str(err)
    assert f"{path}:3" in msg and reason in msg and "a valid record is" in msg and "on_bad_record='skip'" in msg


@pytest.mark.parametrize(("case", "line", "reason"), CASES, ids=[c[0] for c in CASES])
def test_bad_record_skip_mode(case, line, reason, tok, tmp_path, caplog):
    path = _file(tmp_path, line)
    with caplog.at_level(logging.WARNING):
        ds = load_sft_dataset(path, tok, cache_dir=tmp_path / "c", on_bad_record="skip", show_progress=False)
    assert len(ds) == 3
    assert dict(ds.skipped) == {reason: 1}
    assert any("skipped 1 bad record" in r.getMessage() and f"{path}:3 {reason}" in r.getMessage() for r in caplog.records)
    # the cached entry still knows about the bad record: error mode raises from the cache too
    with pytest.raises(BadRecordError, match=f"{reason}"):
        load_sft_dataset(path, tok, cache_dir=tmp_path / "c", show_progress=False)


def test_too_long_without_truncation(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": c} for c in CONVERSATIONS])
    kw = dict(cache_dir=tmp_path / "c", max_length=40, truncate=False, show_progress=False)
    with pytest.raises(BadRecordError, match="too_long") as info:
        load_sft_dataset(path, tok, **kw)
    assert info.value.line == 1 and "max_length=40" in str(info.value)
    ds = load_sft_dataset(path, tok, on_bad_record="skip", **kw)
    assert (ds.lengths <= 40).all() and sum(ds.skipped.values()) + len(ds) == len(CONVERSATIONS)
    assert set(ds.skipped) == {"too_long"}


def test_no_loss_tokens_after_truncation(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CONVERSATIONS[0]}])
    with pytest.raises(BadRecordError, match="no_loss_tokens"):
        load_sft_dataset(path, tok, cache_dir=tmp_path, max_length=5, show_progress=False)
    ds = load_sft_dataset(path, tok, cache_dir=tmp_path, max_length=5, on_bad_record="skip", show_progress=False)
    assert len(ds) == 0 and ds.skipped == {"no_loss_tokens": 1}


def test_template_error(tok, tmp_path):
    from sft_test_data import TAG_TEMPLATE, make_tokenizer

    picky = make_tokenizer(
        "{%- if messages[0]['role'] == 'tool' %}{{ raise_exception('tool first') }}{% endif %}" + TAG_TEMPLATE
    )
    recs = [GOOD, {"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]}]
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    with pytest.raises(BadRecordError, match=r"d.jsonl:2: .*template_error.*tool first"):
        load_sft_dataset(path, picky, cache_dir=tmp_path, show_progress=False)
    ds = load_sft_dataset(path, picky, cache_dir=tmp_path, on_bad_record="skip", show_progress=False)
    assert len(ds) == 1 and ds.skipped == {"template_error": 1}


def test_json_list_file_lines_and_shapes(tok, tmp_path):
    records = [
        {"instruction": "Say hi", "input": "to Bob", "output": "Hi Bob"},
        {"prompt": "Say bye", "response": "Bye", "system": "Be brief."},
        {"messages": []},
    ]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(records, indent=2))
    with pytest.raises(BadRecordError) as info:
        load_sft_dataset(path, tok, cache_dir=tmp_path, show_progress=False)
    text = path.read_text().splitlines()
    assert info.value.reason == "empty_conversation"
    assert text[info.value.line - 1].strip().startswith("{")  # the line where the record starts
    assert '"messages"' in text[info.value.line]
    ds = load_sft_dataset(path, tok, cache_dir=tmp_path, on_bad_record="skip", show_progress=False)
    assert len(ds) == 2
    rendered = [tok.decode(list(map(int, ds[i]["input_ids"]))) for i in range(2)]
    assert "user\nSay hi\n\nto Bob<|im_end|>" in rendered[0] and "assistant\nHi Bob<|im_end|>" in rendered[0]
    assert rendered[1].startswith("<|im_start|>system\nBe brief.<|im_end|>") and "assistant\nBye" in rendered[1]


def test_broken_json_file_raises_in_both_modes(tok, tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[\n{"prompt": "a", "response": "b"},\n{"prompt": \n')
    for mode in ("error", "skip"):
        with pytest.raises(BadRecordError, match="malformed_json") as info:
            load_sft_dataset(path, tok, cache_dir=tmp_path, on_bad_record=mode, show_progress=False)
        assert info.value.line == 4


def test_invalid_options(tok, chat_file, tmp_path):
    with pytest.raises(ValueError, match="'assistant', 'all', 'last_assistant_turn'"):
        load_sft_dataset(chat_file, tok, loss_on="everything", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="'error', 'skip'"):
        load_sft_dataset(chat_file, tok, on_bad_record="ignore", cache_dir=tmp_path)
    for bad in (1, True, 8.0):
        with pytest.raises(ValueError, match=rf"max_length must be an integer >= 2.*, got {bad!r}"):
            load_sft_dataset(chat_file, tok, max_length=bad, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="unsupported file type"):
        bad = tmp_path / "d.csv"
        bad.write_text("a,b\n")
        load_sft_dataset(bad, tok, cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError):
        load_sft_dataset(tmp_path / "missing.jsonl", tok, cache_dir=tmp_path)
    no_template = tok.__class__(tokenizer_object=tok.backend_tokenizer)
    with pytest.raises(ValueError, match="no chat template"):
        load_sft_dataset(chat_file, no_template, cache_dir=tmp_path)


def test_reason_keys_documented():
    others = {"too_long", "no_loss_tokens", "template_error", "special_token_in_content",
              "weight_unsupported"}
    assert {c[2] for c in CASES} | others == set(REASONS)


def test_hf_dataset_source(tok, tmp_path):
    import datasets

    rows = datasets.Dataset.from_list([{"messages": c} for c in CONVERSATIONS[:2]] + [{"messages": []}])
    with pytest.raises(BadRecordError, match="row:3"):
        load_sft_dataset(rows, tok, cache_dir=tmp_path, show_progress=False)
    ds = load_sft_dataset(rows, tok, cache_dir=tmp_path, on_bad_record="skip", show_progress=False)
    assert len(ds) == 2 and ds.skipped == {"empty_conversation": 1}
    assert tok.decode(list(map(int, ds[1]["input_ids"]))) == tok.apply_chat_template(CONVERSATIONS[1], tokenize=False)
