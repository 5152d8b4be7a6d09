"""A resume checks what is trained on the examples, not only what orders them: other loss masks,
another tokenizer or chat template, changed ``weight`` fields are refused by name; refusals name
the key a user sets (``global_batch_size``), not an internal field."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
from sampler.synthetic import SyntheticSFT, mixed_lengths

from megatron_packing.config import PackingConfig
from megatron_packing.data import load_sft_dataset
from megatron_packing.loader.dataloader import build_sft_dataloader

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
PROJECT = Path(__file__).resolve().parents[2]
TOKENIZER = PROJECT / "examples" / "tokenizer"
CONFIG = PackingConfig(global_batch_size=8, bin_capacity=2048, align_packing_bins_to_dp=True,
                       packing_batch_size_allowed_variation=0.25, oversize_policy="truncate")


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("chats")
    lines = (PROJECT / "examples" / "data" / "demo_chat.jsonl").read_text().splitlines()[:40]
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _dataset(path: Path, tokenizer: Path, cache: Path, **options):
    return load_sft_dataset([str(path)], str(tokenizer), cache_dir=str(cache),
                            show_progress=False, **options)


def _state_after_one_step(dataset, config=CONFIG):
    loader = build_sft_dataloader(dataset, config, dp_rank=0, dp_size=2, seed=3)
    next(iter(loader))
    return loader.state_dict()


def _resume(dataset, state, config=CONFIG):
    loader = build_sft_dataloader(dataset, config, dp_rank=0, dp_size=2, seed=3)
    loader.load_state_dict(state)
    return loader


def test_the_same_data_resumes(chats, tmp_path):
    data = _dataset(chats / "train.jsonl", TOKENIZER, tmp_path)
    _resume(data, _state_after_one_step(data))


def test_other_loss_masks_are_refused_naming_loss_on(chats, tmp_path):
    state = _state_after_one_step(_dataset(chats / "train.jsonl", TOKENIZER, tmp_path))
    every_token = _dataset(chats / "train.jsonl", TOKENIZER, tmp_path, loss_on="all")
    with pytest.raises(ValueError, match=r"data.loss_on: saved 'assistant', now 'all'"):
        _resume(every_token, state)


def test_another_chat_template_is_refused_naming_the_tokenizer(chats, tmp_path):
    state = _state_after_one_step(_dataset(chats / "train.jsonl", TOKENIZER, tmp_path))
    other = tmp_path / "tokenizer"
    shutil.copytree(TOKENIZER, other)
    template = (other / "chat_template.jinja").read_text()
    # The system and user turns say who speaks in another way; the assistant turns are as before.
    changed = template.replace("'<|im_start|>' + message['role'] + '\\n'",
                               "'<|im_start|>' + message['role'] + ':\\n'")
    assert changed != template
    (other / "chat_template.jinja").write_text(changed)
    with pytest.raises(ValueError, match=r"data.tokenizer \(its vocabulary, special tokens and "
                                         r"chat template\): saved"):
        _resume(_dataset(chats / "train.jsonl", other, tmp_path), state)


def test_changed_weight_fields_are_refused(chats, tmp_path):
    state = _state_after_one_step(_dataset(chats / "train.jsonl", TOKENIZER, tmp_path))
    records = [json.loads(line) for line in (chats / "train.jsonl").read_text().splitlines()]
    for message in records[0]["messages"]:
        if message["role"] == "assistant":
            message["weight"] = 0
            break
    else:
        pytest.fail("the first chat has no assistant turn")
    records[0]["messages"].append({"role": "assistant", "content": "ok"})
    records[0]["messages"].insert(-1, {"role": "user", "content": "and?"})
    weighted = tmp_path / "weighted.jsonl"
    weighted.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    with pytest.raises(ValueError, match="cannot resume"):
        _resume(_dataset(weighted, TOKENIZER, tmp_path), state)


class _LastQuarter(SyntheticSFT):
    """The same examples, trained on their last quarter instead of their second half."""

    @staticmethod
    def _mask(n: int) -> np.ndarray:
        mask = np.zeros(n, dtype=np.uint8)
        mask[3 * n // 4:] = 1
        return mask


def test_a_dataset_of_ones_own_with_other_targets_is_refused_by_their_digest():
    lengths = mixed_lengths(60, seed=1, high=500)
    state = _state_after_one_step(SyntheticSFT(lengths))
    fewer = _LastQuarter(lengths)
    with pytest.raises(ValueError, match=r"the loss targets per example, sha256\): saved"):
        _resume(fewer, state)


def test_a_refusal_names_the_yaml_key_not_the_internal_field():
    dataset = SyntheticSFT(mixed_lengths(60, seed=1, high=500))
    state = _state_after_one_step(dataset)
    with warnings.catch_warnings(), pytest.raises(ValueError) as refused:
        _resume(dataset, state, CONFIG.with_keys(global_batch_size=10, packing_algorithm="bfd"))
    message = str(refused.value)
    assert "global_batch_size: saved 8, now 10" in message
    assert "packing_algorithm: saved 'mffd', now 'bfd'" in message
    assert "batch_size: saved" not in message.replace("global_batch_size", "")
