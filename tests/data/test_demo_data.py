"""The shipped demo dataset is reproducible from its seed and has a mixed length profile."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("make_demo_data", ROOT / "examples" / "make_demo_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_demo_file_matches_generator(tmp_path):
    mod = _module()
    mod.main(["--out-dir", str(tmp_path), "--no-tokenizer"])
    shipped = ROOT / "examples" / "data" / "demo_chat.jsonl"
    assert (tmp_path / "data" / "demo_chat.jsonl").read_bytes() == shipped.read_bytes()
    assert shipped.stat().st_size < 3_000_000
    assert mod.make_records(1, 50) != mod.make_records(2, 50)


def test_demo_length_profile(tmp_path):
    from megatron_packing.data import load_sft_dataset

    shipped = ROOT / "examples" / "data" / "demo_chat.jsonl"
    ds = load_sft_dataset(shipped, ROOT / "examples" / "tokenizer", cache_dir=tmp_path, show_progress=False)
    n_lines = sum(1 for _ in shipped.open())
    assert 2000 <= len(ds) == n_lines <= 4000 and not ds.skipped
    lengths = np.asarray(ds.lengths)
    assert np.median(lengths) < 100  # many short chats
    assert (lengths > 300).sum() >= 50 and 1000 < lengths.max() <= 1600  # some long ones
    assert (np.asarray(ds.loss_token_counts) > 0).all()
    first = json.loads(shipped.open().readline())
    assert first["messages"][-1]["role"] == "assistant"
