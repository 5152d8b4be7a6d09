"""Length-index cache: reuse when unchanged, rebuild on data/tokenizer/template/option change."""

from __future__ import annotations

import numpy as np
import pytest
from sft_test_data import CONVERSATIONS, PLAIN_TEMPLATE, TAG_TEMPLATE, make_tokenizer, write_jsonl

from megatron_packing.data import chunk_encoding, length_index, load_length_index, load_sft_dataset


@pytest.fixture
def builds(monkeypatch):
    """Count real index builds."""
    calls = []
    real = length_index._build

    def counting(final, *args, **kwargs):
        calls.append(final)
        return real(final, *args, **kwargs)

    monkeypatch.setattr(length_index, "_build", counting)
    return calls


def _load(path, tok, cache, **kw):
    return load_sft_dataset(path, tok, cache_dir=cache, show_progress=False, **kw)


def test_reuse_when_unchanged(tok, chat_file, tmp_path, builds):
    a = _load(chat_file, tok, tmp_path / "c")
    b = _load(chat_file, tok, tmp_path / "c")
    assert len(builds) == 1
    assert a.fingerprint == b.fingerprint and a.index_paths == b.index_paths
    np.testing.assert_array_equal(a.lengths, b.lengths)
    # same content at a new path/mtime is still the same data
    copy = tmp_path / "other" / chat_file.name
    copy.parent.mkdir()
    copy.write_bytes(chat_file.read_bytes())
    c = _load(copy, tok, tmp_path / "c")
    assert len(builds) == 1 and c.fingerprint == a.fingerprint


def test_data_change_invalidates(tok, chat_file, tmp_path, builds):
    a = _load(chat_file, tok, tmp_path / "c")
    write_jsonl(chat_file, [{"messages": c} for c in CONVERSATIONS[:2]])
    b = _load(chat_file, tok, tmp_path / "c")
    assert len(builds) == 2 and len(b) == 2 and a.fingerprint != b.fingerprint


def test_tokenizer_and_template_change_invalidate(tok, chat_file, tmp_path, builds):
    a = _load(chat_file, tok, tmp_path / "c")
    other_vocab = make_tokenizer(TAG_TEMPLATE, vocab_size=300)
    b = _load(chat_file, other_vocab, tmp_path / "c")
    assert len(builds) == 2 and b.fingerprint != a.fingerprint
    other_template = make_tokenizer(TAG_TEMPLATE.replace("<|im_end|>\\n' }}{% endgen", "<|im_end|>' }}{% endgen"))
    c = _load(chat_file, other_template, tmp_path / "c")
    assert len(builds) == 3 and c.fingerprint not in (a.fingerprint, b.fingerprint)
    assert c.num_tokens < a.num_tokens  # the changed template drops a newline per assistant turn
    d = _load(chat_file, make_tokenizer(PLAIN_TEMPLATE), tmp_path / "c")
    assert len(builds) == 4 and d.fingerprint != a.fingerprint
    # and the original is still cached
    _load(chat_file, tok, tmp_path / "c")
    assert len(builds) == 4


def test_option_change_invalidates(tok, chat_file, tmp_path, builds):
    _load(chat_file, tok, tmp_path / "c")
    _load(chat_file, tok, tmp_path / "c", loss_on="all")
    _load(chat_file, tok, tmp_path / "c", max_length=64)
    assert len(builds) == 3
    _load(chat_file, tok, tmp_path / "c", max_length=64)
    assert len(builds) == 3


def test_load_length_index_and_files(tok, chat_file, tmp_path):
    ds = _load(chat_file, tok, tmp_path / "c")
    (path,) = ds.index_paths
    idx = load_length_index(path)
    np.testing.assert_array_equal(idx.lengths, ds.lengths)
    np.testing.assert_array_equal(idx.loss_token_counts, ds.loss_token_counts)
    assert isinstance(idx.lengths, np.memmap) and idx.lengths.dtype == np.int32
    assert not list((tmp_path / "c").glob(".*.*.*[!k]"))  # no temp dirs left behind


def test_parallel_build_matches_serial(tok, tmp_path, monkeypatch):
    monkeypatch.setattr(chunk_encoding, "CHUNK", 7)
    records = [{"messages": CONVERSATIONS[i % 3]} for i in range(40)]
    records[23] = {"messages": []}
    path = write_jsonl(tmp_path / "many.jsonl", records)
    serial = _load(path, tok, tmp_path / "s", num_proc=1, on_bad_record="skip")
    parallel = _load(path, tok, tmp_path / "p", num_proc=2, on_bad_record="skip")
    assert len(serial) == len(parallel) == 39
    assert serial.skipped == parallel.skipped == {"empty_conversation": 1}
    np.testing.assert_array_equal(serial.lengths, parallel.lengths)
    for i in range(len(serial)):
        np.testing.assert_array_equal(serial[i]["input_ids"], parallel[i]["input_ids"])
        np.testing.assert_array_equal(serial[i]["loss_mask"], parallel[i]["loss_mask"])
    with pytest.raises(ValueError, match=r"many.jsonl:24: .*empty_conversation"):
        _load(path, tok, tmp_path / "q", num_proc=2)
