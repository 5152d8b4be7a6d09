"""Every path and token id a user gives is checked where it is read, naming the flag or key and
what would be valid; and every command reads a training YAML the same way (one reader)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from megatron_packing.cli import main
from megatron_packing.config import ConfigError, PackingConfig
from megatron_packing.config.mode_keys import UnusedKeyWarning
from megatron_packing.config.sections import read_sections

PROJECT = Path(__file__).resolve().parents[2]
DEMO = PROJECT / "configs" / "demo_cpu.yaml"


def _packing_yaml(tmp_path: Path, packing: str) -> Path:
    path = tmp_path / "sft.yaml"
    path.write_text(f"packing:\n{packing}data:\n  paths: [{PROJECT}/examples/data/demo_chat.jsonl]"
                    f"\n  tokenizer: {PROJECT}/examples/tokenizer\n")
    return path


# ---------------------------------------------------------------------------- output paths
@pytest.mark.parametrize("command", [
    ["simulate", "--config", str(DEMO)],
    ["tune", "--config", str(DEMO)],
    ["inspect", "--config", str(DEMO), "--with-data"],
    ["calibrate", "--from-timings", "timings.jsonl"],
])
def test_an_output_dir_that_is_a_file_is_refused_before_any_work(command, tmp_path, capsys):
    taken = tmp_path / "report.txt"
    taken.write_text("not a directory")
    assert main([*command, "--output-dir", str(taken)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"megatron-packing {command[0]}: error: --output-dir {taken} is a file, not a directory; "
        "give a directory (it is created when missing)"]
    assert taken.read_text() == "not a directory"


def test_an_output_dir_that_cannot_be_created_names_the_os_error(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(["simulate", "--config", str(DEMO), "--output-dir",
                 str(tmp_path / "file" / "out")]) == 2
    err = capsys.readouterr().err
    assert f"--output-dir {tmp_path / 'file' / 'out'} cannot be created: Not a directory" in err
    assert "Traceback" not in err


# ---------------------------------------------------------------------------- token ids
def test_a_pad_token_beyond_the_vocabulary_is_refused_naming_the_range():
    config = PackingConfig(pad_token_id=2815)
    with pytest.raises(ConfigError, match=r"sft.yaml: packing.pad_token_id 2815 is not in the "
                                          r"vocabulary \(2815 tokens, ids 0 to 2814\)"):
        config.check_token_ids(2815, source="sft.yaml")
    PackingConfig(pad_token_id=2814).check_token_ids(2815, source="sft.yaml")


@pytest.mark.slow
def test_the_demo_refuses_a_pad_token_beyond_its_tokenizer_before_any_rank_starts(tmp_path):
    import subprocess
    import sys

    text = DEMO.read_text().replace("  seed: 1234", "  seed: 1234\n  pad_token_id: 100000")
    assert "pad_token_id: 100000" in text
    config = tmp_path / "demo.yaml"
    config.write_text(text.replace("output_dir: runs/demo_cpu", f"output_dir: {tmp_path / 'run'}"))
    done = subprocess.run([sys.executable, "-m", "megatron_packing.cli", "train", "--config",
                           str(config), "--no-wandb", "--steps", "1"], capture_output=True,
                          text=True, cwd=PROJECT, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "packing.pad_token_id 100000 is not in the vocabulary" in done.stderr
    assert "Traceback" not in done.stderr and "IndexError" not in done.stderr


# ---------------------------------------------------------------------------- one reader
def test_every_command_refuses_a_padded_only_key_in_packed_mode_alike(tmp_path, capsys):
    path = _packing_yaml(tmp_path, "  max_tokens_per_microbatch: 4096\n")
    message = "max_tokens_per_microbatch is only read in padded mode"
    with pytest.raises(ConfigError, match=message):
        read_sections(path, command="the Megatron-LM entry point", reads=("packing", "data"))
    for command in (["simulate", "--config", str(path), "--dp-size", "2"],
                    ["inspect", "--config", str(path)],
                    ["prepare", "--config", str(path)]):
        assert main(command) == 2
        assert message in capsys.readouterr().err


def test_every_command_warns_about_a_packing_key_in_padded_mode_in_one_line(tmp_path, capsys):
    path = _packing_yaml(tmp_path, "  use_sequence_packing: false\n  pad_bins_to_capacity: true\n")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(["inspect", "--config", str(path)]) == 0
    assert [str(w.message) for w in seen if issubclass(w.category, UnusedKeyWarning)] == [
        f"{path}: pad_bins_to_capacity has no effect in padded mode (use_sequence_packing: "
        "false); kept for a packed run of the same file"]


def test_a_warning_about_the_input_is_one_line_naming_the_program(tmp_path):
    import subprocess
    import sys

    path = _packing_yaml(tmp_path, "  use_sequence_packing: false\n  pad_bins_to_capacity: true\n")
    done = subprocess.run([sys.executable, "-m", "megatron_packing.cli", "inspect", "--config",
                           str(path)], capture_output=True, text=True, cwd=PROJECT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        f"megatron-packing inspect: warning: {path}: pad_bins_to_capacity has no effect in "
        "padded mode (use_sequence_packing: false); kept for a packed run of the same file"]


def test_the_trainers_sections_have_no_effect_on_the_entry_point_and_it_says_so(tmp_path):
    path = _packing_yaml(tmp_path, "  seed: 3\n")
    path.write_text(path.read_text() + "logging:\n  wandb: false\n")
    with pytest.warns(UnusedKeyWarning, match="the section logging has no effect on the "
                                              "Megatron-LM entry point"):
        sections = read_sections(path, command="the Megatron-LM entry point",
                                 reads=("packing", "data"))
    assert sections.training is None and sections.packing_values == {"seed": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedKeyWarning)
        assert read_sections(path, command="megatron-packing inspect").training is not None
