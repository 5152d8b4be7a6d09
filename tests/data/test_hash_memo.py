"""The remembered data-file hash: reused while the file is unchanged, never after a write."""

from __future__ import annotations

import json

import pytest
from sft_test_data import CONVERSATIONS, write_jsonl

from megatron_packing.data import length_index, load_sft_dataset


def _load(path, tok, cache):
    return load_sft_dataset(path, tok, cache_dir=cache, show_progress=False)


def _memos(cache):
    return sorted((cache / ".file_hashes").glob("*.json"))


@pytest.fixture
def settled(monkeypatch):
    """Treat every file as settled (its times older than the hash), as an old data file is."""
    monkeypatch.setattr(length_index, "HASH_MEMO_SETTLED_S", -1e9)


def test_a_warm_load_takes_the_remembered_hash(settled, tok, chat_file, tmp_path):
    cache = tmp_path / "c"
    first = _load(chat_file, tok, cache)
    (memo,) = _memos(cache)
    saved = json.loads(memo.read_text())
    assert saved["path"] == str(chat_file.resolve())
    assert saved["hash"] == length_index.hash_file(chat_file)
    saved["hash"] = "0" * 32  # a remembered value is used as is: the key changes with it
    memo.write_text(json.dumps(saved))
    second = _load(chat_file, tok, cache)
    assert second.fingerprint != first.fingerprint


def test_a_write_of_the_same_size_is_hashed_again(settled, tok, chat_file, tmp_path):
    cache = tmp_path / "c"
    before = _load(chat_file, tok, cache)
    text = chat_file.read_text()
    chat_file.write_text(text.replace("tiger", "zebra"))  # same size, other content
    assert len(chat_file.read_text()) == len(text)
    after = _load(chat_file, tok, cache)
    assert after.fingerprint != before.fingerprint
    assert json.loads(_memos(cache)[0].read_text())["hash"] == length_index.hash_file(chat_file)


def test_a_file_written_moments_ago_is_not_remembered(tok, tmp_path):
    path = write_jsonl(tmp_path / "fresh.jsonl", [{"messages": c} for c in CONVERSATIONS])
    _load(path, tok, tmp_path / "c")
    assert _memos(tmp_path / "c") == []


def test_a_warm_load_reads_the_data_file_for_nothing_else(settled, tok, chat_file, tmp_path,
                                                          monkeypatch):
    from megatron_packing.data import load as load_module

    first = _load(chat_file, tok, tmp_path / "c")

    def no_count(path):
        raise AssertionError("a warm load counted the file's lines")

    def no_read(path, memo_dir=None):
        raise AssertionError("a warm load hashed the data file again")

    monkeypatch.setattr(load_module, "count_jsonl_lines", no_count)
    monkeypatch.setattr(length_index, "_hash_file_bytes", no_read)
    assert _load(chat_file, tok, tmp_path / "c").fingerprint == first.fingerprint
