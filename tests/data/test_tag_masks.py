"""Generation-tag masks from token slices equal apply_chat_template's per-token masks."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from sft_test_data import CONVERSATIONS

from megatron_packing.data.tokenize import ChatEncoder, _slice_mask, _span_mask

# multi-byte characters at the start and end of assistant turns, where byte-level tokens split
# one character into several tokens with the same offsets
EDGES = CONVERSATIONS + [
    [{"role": "user", "content": "東京?"}, {"role": "assistant", "content": "東京 ✓"}],
    [{"role": "system", "content": "ü"}, {"role": "user", "content": "é"},
     {"role": "assistant", "content": "✓"}, {"role": "user", "content": "🙂"},
     {"role": "assistant", "content": "🙂🙂 café"}],
]


def reference(tokenizer, batch):
    out = tokenizer.apply_chat_template(batch, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    return out["input_ids"], out["assistant_masks"]


def check(tokenizer):
    encoder = ChatEncoder(tokenizer)
    ids, masks = encoder._tagged_batch(EDGES)
    want_ids, want_masks = reference(tokenizer, EDGES)
    assert [list(i) for i in ids] == want_ids
    assert [m.tolist() for m in masks] == want_masks
    assert any(sum(m) for m in want_masks)


def test_slices_equal_the_per_token_masks_with_the_test_tokenizer(tok):
    check(tok)


def test_slices_equal_the_per_token_masks_with_a_real_vocabulary(real_tok):
    check(real_tok)


class Offsets:
    """The part of a tokenizers Encoding the slices read."""

    def __init__(self, offsets: list[tuple[int, int]]) -> None:
        self.offsets = offsets

    def char_to_token(self, pos: int) -> int | None:
        return next((k for k, (s, e) in enumerate(self.offsets) if s <= pos < e), None)

    def token_to_chars(self, k: int) -> tuple[int, int]:
        return self.offsets[k]


@st.composite
def tokens_and_spans(draw):
    widths = draw(st.lists(st.integers(1, 4), min_size=1, max_size=30))
    offsets, pos = [], 0
    for w in widths:
        offsets.append((pos, pos + w))
        for _ in range(draw(st.integers(0, 2))):  # a character split over several tokens
            offsets.append((pos, pos + w))
        pos += w
        if draw(st.booleans()) and draw(st.booleans()):
            pos += 1  # a character no token holds (dropped whitespace)
    cuts = sorted(draw(st.lists(st.integers(0, pos), max_size=6)))
    spans = list(zip(cuts[::2], cuts[1::2], strict=False))
    return offsets, spans


@settings(max_examples=200, deadline=None)
@given(tokens_and_spans())
def test_a_slice_marks_exactly_the_tokens_overlapping_a_span(case):
    offsets, spans = case
    got = _slice_mask(Offsets(offsets), len(offsets), spans)
    np.testing.assert_array_equal(got, _span_mask(np.asarray(offsets).reshape(-1, 2), spans))


def test_none_keys_are_dropped_and_special_tokens_reach_the_template_as_in_apply_chat_template():
    from sft_test_data import make_tokenizer

    template = (
        "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['role'] == 'assistant' %}{% generation %}"
        "{{- 'content key: ' + (('content' in message) | string) }}"
        "{%- for call in message['tool_calls'] or [] %}{{- ' call ' + call['function']['name'] }}"
        "{%- endfor %}{{- eos_token ~ '\\n' }}{% endgeneration %}"  # the tokenizer's eos
        "{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    )
    tokenizer = make_tokenizer(template)
    call = {"type": "function", "function": {"name": "add", "arguments": "{}"}}
    batch = [[{"role": "user", "content": "add"},
              {"role": "assistant", "content": None, "tool_calls": [call]}]]
    ids, masks = ChatEncoder(tokenizer)._tagged_batch(batch)
    want_ids, want_masks = reference(tokenizer, batch)
    assert "content key: False call add<|im_end|>" in tokenizer.decode(want_ids[0])
    assert [list(i) for i in ids] == want_ids and [m.tolist() for m in masks] == want_masks
