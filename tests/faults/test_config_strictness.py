"""Accepted-but-without-effect configs: one strict reader, keys the mode does not read.

Every config goes through `read_yaml_mapping` (demo trainer, inspect, simulate, tune, the
Megatron-LM entry point): a key or section given twice, a file that is not UTF-8, a directory
or a missing file is one `ConfigError` naming the file (and the line).
"""

from __future__ import annotations

import sys
import warnings

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_packing.config import ConfigError, PackingConfig, load_config
from megatron_packing.config.mode_keys import UnusedKeyWarning
from megatron_packing.config.training import load_training_config
from megatron_packing.config.yaml_io import read_yaml_mapping
from megatron_packing.loader.dataloader import WorkerConfig

from .run_faults_helpers import run_cli, tiny_config, write_config


def write(tmp_path, text, name="train.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- duplicate keys and sections ------------------------------------------------------------

def test_a_duplicate_key_is_refused_with_both_lines(tmp_path):
    path = write(tmp_path, "packing:\n  global_batch_size: 16\n  bin_capacity: 512\n"
                           "  global_batch_size: 64\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}:4: duplicate key 'global_batch_size' (first at "
                                      "line 2)")


def test_a_second_section_is_refused_by_the_training_reader(tmp_path):
    doc = tiny_config(tmp_path)
    text = yaml.safe_dump(doc) + "train:\n  steps: 99\n"
    path = write(tmp_path, text, "c.yaml")
    with pytest.raises(ConfigError, match=r"c\.yaml:\d+: duplicate section 'train' \(first at "
                                          r"line \d+\)"):
        load_training_config(path)


def test_merge_keys_are_not_duplicates(tmp_path):
    path = write(tmp_path, "base: &b {global_batch_size: 16}\nother:\n  <<: *b\n  seed: 3\n")
    assert read_yaml_mapping(path)["other"] == {"global_batch_size": 16, "seed": 3}


@settings(max_examples=40, deadline=None)
@given(keys=st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=6))
def test_a_mapping_loads_exactly_when_its_keys_are_unique(tmp_path_factory, keys):
    path = tmp_path_factory.mktemp("dup") / "k.yaml"
    path.write_text("".join(f"{k}: {i}\n" for i, k in enumerate(keys)))
    if len(set(keys)) == len(keys):
        assert read_yaml_mapping(path) == {k: i for i, k in enumerate(keys)}
    else:
        second = next(i for i, k in enumerate(keys) if k in keys[:i])
        with pytest.raises(ConfigError, match=rf"k\.yaml:{second + 1}: duplicate key"):
            read_yaml_mapping(path)


# ---- file errors ---------------------------------------------------------------------------

def test_a_non_utf8_byte_names_the_file_and_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"packing:\n  seed: 3 # caf\xe9\n")
    with pytest.raises(ConfigError, match=rf"{path}:2: not UTF-8 text \(byte 0xe9"):
        load_config(path)


def test_a_directory_or_a_missing_file_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match=rf"{tmp_path}: is a directory, not a config file"):
        load_training_config(tmp_path)
    with pytest.raises(ConfigError, match="config file not found"):
        load_training_config(tmp_path / "nope.yaml")


# ---- keys the mode does not read -------------------------------------------------------------

@pytest.mark.parametrize("key, value", [("micro_batch_size", 4),
                                        ("max_tokens_per_microbatch", 4096)])
def test_a_padded_only_key_is_refused_in_packed_mode(key, value):
    with pytest.raises(ConfigError, match=rf"t\.yaml: {key} is only read in padded mode"):
        PackingConfig.from_dict({key: value}, source="t.yaml")


def test_a_padded_only_key_at_its_default_is_no_setting():
    config = PackingConfig.from_dict({"micro_batch_size": 1}, source="t.yaml")
    assert PackingConfig.from_dict(config.to_dict()) == config


def test_packing_keys_in_padded_mode_warn_once_naming_them():
    values = {"use_sequence_packing": False, "packing_algorithm": "bfd", "lookahead_steps": 2,
              "micro_batch_size": 2}
    with pytest.warns(UnusedKeyWarning, match="lookahead_steps, packing_algorithm have no effect"):
        PackingConfig.from_dict(values, source="once.yaml")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PackingConfig.from_dict(values, source="once.yaml")  # the same file: not again


@pytest.mark.parametrize("options", [{"prefetch_factor": 4}, {"persistent_workers": True}])
def test_worker_options_without_workers_are_refused(options):
    with pytest.raises(ConfigError, match=f"{next(iter(options))}=.* only applies to loader "
                                          "worker processes, but num_workers is 0"):
        WorkerConfig(num_workers=0, **options)
    WorkerConfig(num_workers=1, **options)


def test_a_missing_validation_file_is_refused(tmp_path):
    path = write_config(tmp_path / "c.yaml",
                        tiny_config(tmp_path, data__valid_paths=[str(tmp_path / "v.jsonl")]))
    with pytest.raises(ConfigError, match=r"data\.valid_paths\[0\] .*v\.jsonl' does not exist"):
        load_training_config(path)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["inspect", "tune", "simulate"])
def test_every_command_reads_with_the_strict_reader(tmp_path, command):
    doc = tiny_config(tmp_path)
    path = write(tmp_path, yaml.safe_dump(doc) + "packing:\n  seed: 4\n", "c.yaml")
    result = run_cli([sys.executable, "-m", "megatron_packing.cli", command, "--config", str(path)], timeout=120)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "duplicate section 'packing'" in result.stderr
    assert "Traceback" not in result.stderr
