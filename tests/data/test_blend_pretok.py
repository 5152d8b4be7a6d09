"""Weighted blends and the pre-tokenized save/load round trip."""

from __future__ import annotations

import numpy as np
import pytest
from sft_test_data import CONVERSATIONS, make_tokenizer, write_jsonl

from megatron_packing.data import load_length_index, load_sft_dataset, save_pretokenized
from megatron_packing.data.blend import blend_counts, blend_indices


@pytest.fixture
def two_files(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"messages": CONVERSATIONS[0]}] * 10)
    b = write_jsonl(tmp_path / "b.jsonl", [{"messages": CONVERSATIONS[1]}] * 30)
    return a, b


def _ids(ds):
    return [tuple(ds[i]["input_ids"]) for i in range(len(ds))]


def test_blend_deterministic_and_seeded(tok, two_files, tmp_path):
    a, b = two_files
    kw = dict(cache_dir=tmp_path / "c", show_progress=False)
    d1 = load_sft_dataset({a: 3.0, b: 1.0}, tok, seed=7, **kw)
    d2 = load_sft_dataset([(a, 3.0), (b, 1.0)], tok, seed=7, **kw)
    d3 = load_sft_dataset([a, b], tok, weights=[3, 1], seed=7, **kw)
    d4 = load_sft_dataset({a: 3.0, b: 1.0}, tok, seed=8, **kw)
    assert len(d1) == 40
    assert _ids(d1) == _ids(d2) == _ids(d3)
    assert d1.fingerprint == d2.fingerprint == d3.fingerprint != d4.fingerprint
    assert _ids(d1) != _ids(d4)
    n_a = sum(1 for x in _ids(d1) if x == tuple(d1.stores[0].get(0)["input_ids"]))
    assert n_a == 30  # 40 * 3/4 from a (10 examples, each used 3 times)
    np.testing.assert_array_equal(d1.lengths, [len(x) for x in _ids(d1)])
    np.testing.assert_array_equal(d1.loss_token_counts, [d1[i]["loss_mask"][1:].sum() for i in range(40)])


def test_plain_list_concatenates(tok, two_files, tmp_path):
    a, b = two_files
    ds = load_sft_dataset([a, b], tok, cache_dir=tmp_path, show_progress=False)
    assert len(ds) == 40 and ds[0]["input_ids"].tolist() != ds[39]["input_ids"].tolist()
    assert ds[-1]["input_ids"].tolist() == ds[39]["input_ids"].tolist()
    with pytest.raises(IndexError):
        ds[40]


@pytest.mark.parametrize(("weights", "fragment"), [
    ([1.0], "got 1 weights for 2 sources"),
    ([1.0, 0.0], r"weights\[1\] must be a number > 0, got 0.0"),
    ([1.0, -2.0], r"weights\[1\] must be a number .*, got -2.0"),
    ([1.0, float("nan")], r"weights\[1\] must be a number .*, got nan"),
    ([1.0, "x"], r"weights\[1\] must be a number .*, got 'x'"),
    ([True, 1], r"weights\[0\] must be a number .*, got True"),
])
def test_weights_validated(tok, two_files, tmp_path, weights, fragment):
    with pytest.raises(ValueError, match=fragment):
        load_sft_dataset(list(two_files), tok, weights=weights, cache_dir=tmp_path, show_progress=False)


def test_weights_twice_rejected(tok, two_files, tmp_path):
    a, b = two_files
    with pytest.raises(ValueError, match="not both"):
        load_sft_dataset({a: 1, b: 1}, tok, weights=[1, 1], cache_dir=tmp_path)
    with pytest.raises(ValueError, match="several sources"):
        load_sft_dataset(a, tok, weights=[1], cache_dir=tmp_path)


def test_blend_counts_and_coverage():
    counts = blend_counts([10, 30, 5], [1, 1, 2])
    assert counts.tolist() == [11, 11, 23]  # 11.25, 11.25, 22.5: the largest remainder wins
    part, local = blend_indices([10, 30], [1, 1], seed=0)
    # down-weighted source b (30 -> 20) is subsampled without repeats; a (10 -> 20) used twice each
    assert np.bincount(local[part == 0], minlength=10).tolist() == [2] * 10
    assert len(set(local[part == 1].tolist())) == 20


def test_pretokenized_round_trip(tok, two_files, tmp_path):
    a, b = two_files
    ds = load_sft_dataset({a: 1, b: 2}, tok, seed=3, cache_dir=tmp_path / "c", show_progress=False)
    out = save_pretokenized(ds, tmp_path / "pretok")
    assert not list(out.glob("*.pkl")) and (out / "meta.json").is_file()
    back = load_sft_dataset(out, tok, cache_dir=tmp_path / "c2", show_progress=False)
    again = load_sft_dataset(str(out), None)
    assert len(back) == len(ds) == len(again)
    for i in range(len(ds)):
        for key in ("input_ids", "loss_mask"):
            np.testing.assert_array_equal(back[i][key], ds[i][key])
            assert back[i][key].dtype == ds[i][key].dtype
    np.testing.assert_array_equal(back.lengths, ds.lengths)
    np.testing.assert_array_equal(back.loss_token_counts, ds.loss_token_counts)
    np.testing.assert_array_equal(load_length_index(out).lengths, ds.lengths)
    assert back.fingerprint == again.fingerprint
    # a pre-tokenized file mixes with raw sources
    mixed = load_sft_dataset([out, a], tok, cache_dir=tmp_path / "c", show_progress=False)
    assert len(mixed) == len(ds) + 10


def test_pretokenized_mismatch_is_an_error(tok, two_files, tmp_path):
    ds = load_sft_dataset(two_files[0], tok, cache_dir=tmp_path / "c", show_progress=False)
    out = save_pretokenized(ds, tmp_path / "pretok")
    with pytest.raises(ValueError, match="different tokenizer"):
        load_sft_dataset(out, make_tokenizer(vocab_size=300))
    with pytest.raises(ValueError, match="loss_on='assistant'"):
        load_sft_dataset(out, tok, loss_on="all")
    with pytest.raises(ValueError, match="needs a tokenizer"):
        load_sft_dataset([out, two_files[1]], None)


def test_pickle_reopens_maps(tok, two_files, tmp_path):
    import pickle

    ds = load_sft_dataset(two_files[1], tok, cache_dir=tmp_path, show_progress=False)
    blob = pickle.dumps(ds)
    assert len(blob) < 4000 + 8 * len(ds)  # paths and index arrays, not the token data
    back = pickle.loads(blob)
    assert back.fingerprint == ds.fingerprint
    np.testing.assert_array_equal(back[5]["input_ids"], ds[5]["input_ids"])
