"""``megatron-packing prepare``: builds the length-index cache the jobs then load untouched."""

from __future__ import annotations

import fcntl
import json
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from megatron_packing.cli import main
from megatron_packing.config.data_loading import load_data_split
from megatron_packing.config.training import load_training_config
from megatron_packing.data import chunk_encoding, length_index

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "data" / "demo_chat.jsonl"
TOKENIZER = ROOT / "examples" / "tokenizer"
PACKING = {"global_batch_size": 8, "bin_capacity": 512, "align_packing_bins_to_dp": True,
           "packing_batch_size_allowed_variation": 0.25, "oversize_policy": "truncate"}


@pytest.fixture()
def data_files(tmp_path: Path) -> dict[str, Path]:
    lines = DEMO.read_text().splitlines(keepends=True)
    train, valid = tmp_path / "train.jsonl", tmp_path / "valid.jsonl"
    train.write_text("".join(lines[:2500]))
    valid.write_text("".join(lines[2500:2700]))
    return {"train": train, "valid": valid}


def write_yaml(tmp_path: Path, data: dict, *, trainer: bool = False, name: str = "sft.yaml") -> Path:
    document: dict = {"packing": PACKING, "data": data}
    if trainer:  # a demo-trainer YAML: the trainer's own sections as well
        document.update(train={"dp_size": 2, "steps": 1}, model={}, logging={"wandb": False})
    path = tmp_path / name
    path.write_text(yaml.safe_dump(document))
    return path


def base_data(tmp_path: Path, files: dict[str, Path], **extra) -> dict:
    return {"paths": [str(files["train"])], "valid_paths": [str(files["valid"])],
            "tokenizer": str(TOKENIZER), "cache_dir": str(tmp_path / "cache"), **extra}


def figures(out: str, split: str) -> dict[str, str]:
    block = out.split(f"{split} (data.")[1].split("\n\n")[0]
    found = {}
    for key in ("examples", "tokens", "loss tokens", "skipped", "cache", "time"):
        match = re.search(rf"^  {key} +(.+)$", block, re.MULTILINE)
        assert match, (key, block)
        found[key] = match.group(1)
    return found


def cache_files(cache: Path) -> dict[str, bytes]:
    return {str(p.relative_to(cache)): p.read_bytes() for p in sorted(cache.rglob("*"))
            if p.is_file() and not p.name.endswith(".lock") and ".file_hashes" not in p.parts}


def entry_stamps(cache: Path) -> dict[Path, int]:
    """The modification times of the cache entries' files (not the file-hash memos)."""
    return {p: p.stat().st_mtime_ns for p in cache.glob("*/*")
            if p.is_file() and ".file_hashes" not in p.parts}


def test_builds_then_present_and_the_trainer_loads_without_tokenizing(tmp_path, data_files,
                                                                      capsys, monkeypatch):
    config = write_yaml(tmp_path, base_data(tmp_path, data_files), trainer=True)
    assert main(["prepare", "--config", str(config)]) == 0
    first = capsys.readouterr().out
    train, valid = figures(first, "train"), figures(first, "valid")
    assert train["cache"].endswith("(built)") and valid["cache"].endswith("(built)")
    assert train["cache"] != valid["cache"]
    cache = tmp_path / "cache"
    stamps = entry_stamps(cache)

    def no_build(*args, **kwargs):
        raise AssertionError("tokenized although prepare built the cache")

    monkeypatch.setattr(length_index, "_build", no_build)
    assert main(["prepare", "--config", str(config), "--workers", "2"]) == 0
    second = capsys.readouterr().out
    for split in ("train", "valid"):
        assert figures(second, split)["cache"].endswith("(already present)")
    cfg = load_training_config(config)
    from megatron_packing.demo.trainer import _load_dataset

    for split, ds in (("train", _load_dataset(cfg)),
                      ("valid", _load_dataset(cfg, cfg.data.valid_paths))):
        shown = figures(first, split)
        assert int(shown["examples"]) == len(ds) > 0
        assert int(shown["tokens"]) == ds.num_tokens
        assert int(shown["loss tokens"]) == int(np.asarray(ds.loss_token_counts).sum())
        assert shown["skipped"] == "0"
        assert shown["cache"] == f"{ds.index_paths[0]} (built)"
    assert entry_stamps(cache) == stamps and len(stamps) >= 8


def test_packing_config_is_read_and_the_entry_point_call_hits_the_cache(tmp_path, data_files,
                                                                        capsys, monkeypatch):
    config = write_yaml(tmp_path, base_data(tmp_path, data_files))
    assert main(["prepare", "--config", str(config)]) == 0
    capsys.readouterr()
    monkeypatch.setattr(length_index, "_build", lambda *a, **k: pytest.fail("tokenized"))
    from megatron_packing.megatron_lm.entry import _load_datasets, read_packing_yaml

    # No process group here: the entry point's load makes no collective call.
    _, _, data = read_packing_yaml(str(config))
    train, valid = _load_datasets(data, vocab_limit=1 << 20)
    assert (len(train), len(valid)) == (2500, 200)
    assert len(load_data_split(data, data.paths)) == 2500


def test_two_workers_give_byte_identical_cache_files(tmp_path, data_files, capsys, monkeypatch):
    pools: list[int] = []
    encode = chunk_encoding.ordered_results

    def spy(items, raw_is_text, encoder, num_proc):
        pools.append(num_proc)
        return encode(items, raw_is_text, encoder, num_proc)

    monkeypatch.setattr(chunk_encoding, "ordered_results", spy)
    built = {}
    for workers in (1, 2):
        data = base_data(tmp_path, data_files, cache_dir=str(tmp_path / f"cache{workers}"))
        config = write_yaml(tmp_path, data, name=f"w{workers}.yaml")
        assert main(["prepare", "--config", str(config), "--workers", str(workers)]) == 0
        assert f"({workers} worker" in capsys.readouterr().out
        built[workers] = cache_files(tmp_path / f"cache{workers}")
    assert pools == [1, 1, 2, 2]  # train and valid, with the processes asked for
    assert len(built[1]) >= 8 and built[1] == built[2]


def test_skipped_records_are_counted_by_reason(tmp_path, data_files, capsys):
    bad = tmp_path / "bad.jsonl"
    good = data_files["valid"].read_text().splitlines(keepends=True)[:20]
    bad.write_text("".join(good) + "{not json\n" + json.dumps(
        {"messages": [{"role": "user", "content": "hi"}]}) + "\n{oops\n")
    data = base_data(tmp_path, {"train": bad, "valid": data_files["valid"]},
                     on_bad_record="skip", valid_paths=[])
    assert main(["prepare", "--config", str(write_yaml(tmp_path, data))]) == 0
    out = capsys.readouterr().out
    shown = figures(out, "train")
    assert shown["examples"] == "20"
    assert shown["skipped"] == "3 (malformed_json=2, no_assistant_turn=1)"
    assert "valid (data.valid_paths): none" in out


def refusal(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("megatron-packing prepare: error: "), lines
    return lines[0]


@pytest.mark.parametrize("trainer", [False, True])
def test_refuses_a_config_without_data_paths(tmp_path, data_files, capsys, trainer):
    config = write_yaml(tmp_path, base_data(tmp_path, data_files, paths=[]), trainer=trainer)
    assert "data.paths must be a non-empty list" in refusal(capsys, ["prepare", "--config",
                                                                     str(config)])


def test_refuses_a_missing_data_file(tmp_path, data_files, capsys):
    data = base_data(tmp_path, data_files, valid_paths=[str(tmp_path / "gone.jsonl")])
    message = refusal(capsys, ["prepare", "--config", str(write_yaml(tmp_path, data))])
    assert "data.valid_paths[0]" in message and "gone.jsonl" in message
    assert "does not exist" in message
    assert not (tmp_path / "cache").exists()  # checked before any build


def test_refuses_an_unreadable_data_file(tmp_path, data_files, capsys):
    folder = tmp_path / "folder.jsonl"
    folder.mkdir()  # a directory that is not pre-tokenized data
    data = base_data(tmp_path, data_files, paths=[str(folder)])
    message = refusal(capsys, ["prepare", "--config", str(write_yaml(tmp_path, data))])
    assert "cannot load data.paths" in message and "not pre-tokenized" in message


def test_refuses_without_cache_dir(tmp_path, data_files, capsys):
    data = base_data(tmp_path, data_files)
    del data["cache_dir"]
    message = refusal(capsys, ["prepare", "--config", str(write_yaml(tmp_path, data))])
    assert "data.cache_dir is not set" in message and "set data.cache_dir" in message


def test_refuses_a_bad_record_under_error(tmp_path, data_files, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(data_files["valid"].read_text() + "{not json\n")
    data = base_data(tmp_path, {"train": bad, "valid": data_files["valid"]})
    message = refusal(capsys, ["prepare", "--config", str(write_yaml(tmp_path, data))])
    assert f"{bad}:201: bad record (malformed_json)" in message


def test_workers_below_one_is_a_usage_error(tmp_path, data_files, capsys):
    config = write_yaml(tmp_path, base_data(tmp_path, data_files))
    with pytest.raises(SystemExit) as exc:
        main(["prepare", "--config", str(config), "--workers", "0"])
    assert exc.value.code == 2
    assert "--workers must be an integer >= 1, got 0" in capsys.readouterr().err


def test_names_a_lock_held_by_another_build_and_waits_for_it(tmp_path, data_files, capsys):
    first = base_data(tmp_path, data_files, valid_paths=[], cache_dir=str(tmp_path / "a"))
    assert main(["prepare", "--config", str(write_yaml(tmp_path, first, name="a.yaml"))]) == 0
    capsys.readouterr()
    (lock_name,) = [p.name for p in (tmp_path / "a").glob(".*.lock")]
    other = tmp_path / "b"
    other.mkdir()
    config = write_yaml(tmp_path, {**first, "cache_dir": str(other)}, name="b.yaml")
    result: list[int] = []
    with (other / lock_name).open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the other build
        runner = threading.Thread(target=lambda: result.append(
            main(["prepare", "--config", str(config)])))
        runner.start()
        time.sleep(1.0)
        assert runner.is_alive() and not result  # waiting behind the lock
        fcntl.flock(held, fcntl.LOCK_UN)
    runner.join(60)
    assert result == [0]
    captured = capsys.readouterr()
    assert f"another build holds the lock {other / lock_name}; waiting" in captured.err
    assert figures(captured.out, "train")["cache"].endswith("(built)")
