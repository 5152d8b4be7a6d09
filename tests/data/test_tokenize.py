"""Rendering round trip, loss masks per mode, generation-tag vs prefix fallback."""

from __future__ import annotations

import numpy as np
import pytest
from sft_test_data import CONVERSATIONS

from megatron_packing.data import load_sft_dataset
from megatron_packing.data.tokenize import ChatEncoder, _runs


def _assistant_texts(messages):
    # what the template renders for each assistant turn: content + end of turn
    return [m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant"]


def _decode(tok, ids):
    return tok.decode(list(map(int, ids)), skip_special_tokens=False, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("fixture", ["tok", "tok_plain"])
def test_round_trip_and_assistant_mask(fixture, request, chat_file, tmp_path):
    tok = request.getfixturevalue(fixture)
    ds = load_sft_dataset(chat_file, tok, cache_dir=tmp_path / "cache", show_progress=False)
    assert ds.options["method"] == ("generation_tags" if fixture == "tok" else "prefix_fallback")
    assert len(ds) == len(CONVERSATIONS)
    for i, conv in enumerate(CONVERSATIONS):
        ex = ds[i]
        ids, mask = ex["input_ids"], ex["loss_mask"]
        assert ids.dtype == np.int64 and mask.dtype == np.uint8 and ids.shape == mask.shape
        assert _decode(tok, ids) == tok.apply_chat_template(conv, tokenize=False)
        starts, ends = _runs(mask)
        assert [_decode(tok, ids[a:b]) for a, b in zip(starts, ends, strict=True)] == _assistant_texts(conv)
        assert ds.lengths[i] == len(ids)
        assert ds.loss_token_counts[i] == int(mask[1:].sum())
    assert ds.lengths.dtype == np.int32 and ds.loss_token_counts.dtype == np.int32


@pytest.mark.parametrize("loss_on", ["assistant", "all", "last_assistant_turn"])
def test_tags_and_fallback_agree(tok, tok_plain, loss_on):
    a = ChatEncoder(tok, loss_on)
    b = ChatEncoder(tok_plain, loss_on)
    assert a.method == "generation_tags" and b.method == "prefix_fallback"
    for conv in CONVERSATIONS:
        ids_a, mask_a = a.encode(conv)
        ids_b, mask_b = b.encode(conv)
        np.testing.assert_array_equal(ids_a, ids_b)
        np.testing.assert_array_equal(mask_a, mask_b)
    # the forced fallback on the tagged template agrees too
    c = ChatEncoder(tok, loss_on, force_fallback=True)
    for conv in CONVERSATIONS:
        np.testing.assert_array_equal(a.encode(conv)[1], c.encode(conv)[1])


def test_loss_modes(tok):
    conv = CONVERSATIONS[1]
    ids, mask_all = ChatEncoder(tok, "all").encode(conv)
    assert mask_all.all()
    _, mask_asst = ChatEncoder(tok, "assistant").encode(conv)
    _, mask_last = ChatEncoder(tok, "last_assistant_turn").encode(conv)
    assert len(_runs(mask_asst)[0]) == 2
    s, e = _runs(mask_last)
    assert len(s) == 1
    assert _decode(tok, ids[s[0] : e[0]]) == _assistant_texts(conv)[-1]
    assert set(np.flatnonzero(mask_last)) < set(np.flatnonzero(mask_asst))


def test_loss_modes_through_loader(tok, chat_file, tmp_path):
    counts = {}
    for mode in ("assistant", "all", "last_assistant_turn"):
        ds = load_sft_dataset(chat_file, tok, loss_on=mode, cache_dir=tmp_path, show_progress=False)
        counts[mode] = ds.loss_token_counts.copy()
        np.testing.assert_array_equal(
            ds.loss_token_counts, [ds[i]["loss_mask"][1:].sum() for i in range(len(ds))]
        )
    np.testing.assert_array_equal(counts["all"], ds.lengths - 1)
    assert (counts["last_assistant_turn"] <= counts["assistant"]).all()
    assert (counts["last_assistant_turn"] < counts["assistant"]).any()


def test_truncation(tok, chat_file, tmp_path):
    kw = dict(cache_dir=tmp_path, loss_on="all", show_progress=False)
    full = load_sft_dataset(chat_file, tok, **kw)
    cut = load_sft_dataset(chat_file, tok, max_length=30, **kw)
    assert (full.lengths > 30).any()
    assert len(cut) == len(full)
    for i in range(len(full)):
        n = min(30, int(full.lengths[i]))
        assert cut.lengths[i] == n
        np.testing.assert_array_equal(cut[i]["input_ids"], full[i]["input_ids"][:n])
        np.testing.assert_array_equal(cut[i]["loss_mask"], full[i]["loss_mask"][:n])
        assert cut.loss_token_counts[i] == cut[i]["loss_mask"][1:].sum()


def test_shipped_demo_tokenizer_has_generation_tags():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    ds_tok = root / "examples" / "tokenizer"
    enc = ChatEncoder(__import__("megatron_packing.data.tokenize", fromlist=["x"]).load_tokenizer(ds_tok))
    assert enc.method == "generation_tags"
    ids, mask = enc.encode(CONVERSATIONS[0])
    assert mask[1:].sum() > 0
