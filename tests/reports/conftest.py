"""A tiny SFT dataset, a saved tokenizer and training YAMLs for the report commands."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml
from data.sft_test_data import make_tokenizer


def chat_records(n: int, seed: int = 0) -> list[dict]:
    """Chats of varied length (about 50 to 300 tokens with the test tokenizer)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        words = " ".join(["apple river stone cloud"] * rng.choice([1, 1, 2, 3, 5, 8, 13, 30, 60]))
        out.append({"messages": [
            {"role": "user", "content": f"Question {i}: what is {a} + {b}? {words}"},
            {"role": "assistant", "content": f"{a} + {b} = {a + b}. The answer is {a + b}."},
        ]})
    return out


@pytest.fixture(scope="session")
def report_data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("report_data")
    tokenizer = root / "tokenizer"
    make_tokenizer().save_pretrained(tokenizer)
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_records(240)))
    return {"root": root, "tokenizer": tokenizer, "data": data}


def write_config(path: Path, report_data: dict[str, Path], *, packing: dict | None = None,
                 data: dict | None = None, train: dict | None = None) -> Path:
    """A Megatron-LM style YAML (packing + data), or with ``train`` a section more."""
    document = {
        "packing": {"global_batch_size": 16, "bin_capacity": 256, "align_packing_bins_to_dp": True,
                    "packing_batch_size_allowed_variation": 0.25, "oversize_policy": "truncate",
                    "seed": 7, **(packing or {})},
        "data": {"paths": [str(report_data["data"])], "tokenizer": str(report_data["tokenizer"]),
                 "cache_dir": str(path.parent / "cache"), **(data or {})},
    }
    if train is not None:
        document["train"] = train
    path.write_text(yaml.safe_dump(document))
    return path
