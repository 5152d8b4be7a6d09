"""A quiet first run: known harmless third-party warnings collapse into one counted line, anything
else shows, and ``--verbose`` / ``PYTHONWARNINGS`` show everything.

The fast tests emit warnings attributed to files inside fake package folders (``warn_explicit``)
and log records on the emitting loggers, with the hook that showed warnings before recording what
reaches it. The slow test runs ``megatron-packing train`` on the demo config and reads its merged
stdout and stderr in order.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatron_packing import cli
from megatron_packing.common import quiet_start
from megatron_packing.common.quiet_start import INHERIT_ENV, KNOWN_WARNINGS

REPO = Path(__file__).resolve().parents[2]

# What megatron-core 0.16.1 / 0.19.2, Megatron-LM's training package and torchdata print on the
# demo and the entry point (their texts, as emitted), each with the file that emits it.
REAL_WARNINGS = [
    ("megatron/core/distributed/fsdp/src/megatron_fsdp/mixed_precision.py",
     "Transformer Engine and Apex are not installed. Falling back to local implementations of "
     "multi_tensor_applier and multi_tensor_scale"),
    ("megatron/core/optimizer/__init__.py",
     "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."),
    ("megatron/core/optimizer/clip_grads.py",
     "Transformer Engine and Apex are not installed. Falling back to local implementations of "
     "multi_tensor_applier, multi_tensor_l2norm, and multi_tensor_scale"),
    ("megatron/training/utils.py",
     "Transformer Engine and Apex are not installed. Falling back to local implementations of "
     "multi_tensor_applier and multi_tensor_l2norm"),
    ("megatron/core/models/backends.py", "Apex is not installed. Falling back to Torch Norm"),
    ("torchdata/stateful_dataloader/stateful_dataloader.py",
     "'set_vital' is deprecated, please do not call"),
    ("megatron/core/transformer/transformer_config.py",
     "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer."),
    ("megatron/core/transformer/transformer_config.py",
     "full scope is deprecated. Use empty cuda_graph_modules to capture the whole layer."),
    ("megatron/core/hyper_comm_grid.py",
     "absl.logging is not installed. Using logging.getLogger(__name__) instead. Please install "
     "absl.logging with `pip install absl-py` to use absl.logging."),
]
LEGACY_TOKENIZER = ("You're using the legacy tokenizer system, which is deprecated and will be "
                    "removed in a future release. Please migrate to the new tokenizer system "
                    "(`megatron.core.tokenizers.MegatronTokenizer`).")
TOKENIZER_LOGGER = "megatron.core.datasets.megatron_tokenizer"


@pytest.fixture
def shown(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The texts of the warnings that reach the hook that showed warnings before the quiet
    start; every warning passes Python's filters, and the quiet start is undone afterwards."""
    monkeypatch.delenv(INHERIT_ENV, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "warnoptions", [])
    texts: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *rest: texts.append(str(message))
        try:
            yield texts
        finally:
            quiet_start.end()


def _emit(folder: Path, relative: str, text: str) -> None:
    warnings.warn_explicit(text, UserWarning, str(folder / relative), 1)


def test_each_real_warning_is_known_to_exactly_one_entry(tmp_path):
    site = tmp_path / "site-packages"
    for relative, text in REAL_WARNINGS:
        matched = [e.label for e in KNOWN_WARNINGS if e.matches_warning(text, str(site / relative))]
        assert len(matched) == 1, (text, matched)
    record = logging.LogRecord(TOKENIZER_LOGGER, logging.WARNING, "x.py", 1, LEGACY_TOKENIZER,
                               None, None)
    assert [e.label for e in KNOWN_WARNINGS if e.matches_record(record)] == \
        ["Megatron's legacy tokenizer"]
    assert all(entry.why and entry.package for entry in KNOWN_WARNINGS)


def test_known_warnings_are_collapsed_and_counted(shown, tmp_path, capsys):
    quiet_start.begin("prog: starting", verbose=False, verbose_flag="--verbose")
    for relative, text in REAL_WARNINGS[:7]:
        _emit(tmp_path / "site-packages", relative, text)
    logger = logging.getLogger(TOKENIZER_LOGGER)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        logger.warning(LEGACY_TOKENIZER)
        logger.warning("a notice of megatron-core's that is not known")
    finally:
        logger.removeHandler(handler)
    assert shown == []
    assert records == ["a notice of megatron-core's that is not known"]
    quiet_start.report("> ")
    quiet_start.report("> ")  # once only
    assert capsys.readouterr().out == (
        "prog: starting\n"
        "> (hid 8 known third-party start-up warnings: Transformer Engine and Apex not "
        "installed, Apex not installed, torchdata's deprecated set_vital call, megatron-core's "
        "deprecated default CUDA-graph scope, Megatron's legacy tokenizer; --verbose shows "
        "them)\n")


def test_unknown_warnings_still_show(shown, tmp_path, capsys):
    quiet_start.begin(None, verbose=False, verbose_flag="--verbose")
    warnings.warn("a warning of a kind nobody declared", stacklevel=1)
    _emit(tmp_path / "site-packages", "megatron/core/x.py", "Apex is missing its fused Adam")
    # A known text, but not from the package that emits it: from another package, or from this
    # project's own megatron_packing/megatron/ (a folder named megatron inside a package).
    _emit(tmp_path / "site-packages", "torch/nn/x.py", "Apex is not installed. Falling back to "
          "Torch Norm")
    own = tmp_path / "megatron_packing"
    (own / "megatron").mkdir(parents=True)
    (own / "__init__.py").write_text("")
    _emit(tmp_path, "megatron_packing/megatron/x.py", "'set_vital' is deprecated")
    _emit(tmp_path, "megatron_packing/megatron/y.py", "Apex is not installed. Falling back to "
          "Torch Norm")
    assert len(shown) == 5
    quiet_start.report()
    assert capsys.readouterr().out == ""  # nothing hidden: no collapsed line


def test_verbose_shows_every_warning(shown, tmp_path, monkeypatch):
    monkeypatch.setenv(INHERIT_ENV, "--verbose")  # from an outer quiet program: dropped
    assert quiet_start.begin(None, verbose=True, verbose_flag="--verbose") is None
    for relative, text in REAL_WARNINGS:
        _emit(tmp_path / "site-packages", relative, text)
    assert shown == [text for _, text in REAL_WARNINGS]
    assert INHERIT_ENV not in os.environ  # the ranks it spawns show everything too


def test_warning_options_show_every_warning(shown, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "warnoptions", ["default"])
    assert quiet_start.begin(None, verbose=False, verbose_flag="--verbose") is None
    assert quiet_start.inherit() is None
    _emit(tmp_path / "site-packages", *REAL_WARNINGS[0])
    assert shown == [REAL_WARNINGS[0][1]]


def test_only_global_rank_zero_prints(shown, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    quiet_start.begin("prog: starting", verbose=False, verbose_flag="--verbose")
    _emit(tmp_path / "site-packages", *REAL_WARNINGS[0])
    quiet_start.report()
    assert shown == [] and capsys.readouterr().out == ""


def test_end_shows_warnings_again(shown, tmp_path):
    quiet_start.begin(None, verbose=False, verbose_flag="--verbose")
    quiet_start.end()
    _emit(tmp_path / "site-packages", *REAL_WARNINGS[0])
    logging.getLogger(TOKENIZER_LOGGER).warning(LEGACY_TOKENIZER)
    assert shown == [REAL_WARNINGS[0][1]]
    assert not logging.getLogger(TOKENIZER_LOGGER).filters
    assert INHERIT_ENV not in os.environ


_CHILD = """
import warnings
from megatron_packing.common import quiet_start
quiet_start.inherit()
warnings.warn_explicit({text!r}, UserWarning, {path!r}, 1)
quiet_start.report("[child] ")
"""


def _child(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """A spawned process of a quiet program, as a fresh interpreter with ``env``."""
    relative, text = REAL_WARNINGS[0]
    code = _CHILD.format(text=text, path=str(tmp_path / "site-packages" / relative))
    base = {k: v for k, v in os.environ.items() if k not in (INHERIT_ENV, "PYTHONWARNINGS")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**base, "PYTHONPATH": str(REPO), **env}, timeout=60, check=True)


def test_a_spawned_process_inherits_the_collapse(tmp_path):
    quiet = _child(tmp_path, **{INHERIT_ENV: "--verbose"})
    assert quiet.stderr == ""
    assert quiet.stdout.startswith("[child] (hid 1 known third-party start-up warning: "
                                   "Transformer Engine and Apex not installed; --verbose")
    alone = _child(tmp_path)  # not spawned by a quiet program
    assert "UserWarning: Transformer Engine and Apex are not installed" in alone.stderr
    assert alone.stdout == ""


def test_pythonwarnings_in_the_environment_shows_everything(tmp_path):
    shown = _child(tmp_path, **{INHERIT_ENV: "--verbose", "PYTHONWARNINGS": "default"})
    assert "UserWarning: Transformer Engine and Apex are not installed" in shown.stderr
    assert shown.stdout == ""


def test_train_starts_and_ends_the_quiet_start(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv(INHERIT_ENV, raising=False)
    monkeypatch.setattr(sys, "warnoptions", [])
    calls: list[dict] = []
    begin = quiet_start.begin

    def recording_begin(first_line, **kwargs):
        calls.append({"first_line": first_line, **kwargs})
        result = begin(first_line, **kwargs)
        calls[-1]["inherited"] = os.environ.get(INHERIT_ENV)
        return result

    monkeypatch.setattr(quiet_start, "begin", recording_begin)
    missing = str(tmp_path / "missing.yaml")
    before = warnings.showwarning
    assert cli.main(["train", "--config", missing]) == 2
    assert cli.main(["train", "--config", missing, "--verbose"]) == 2
    assert calls == [
        {"first_line": f"megatron-packing train: starting with {missing}", "verbose": False,
         "verbose_flag": "--verbose", "inherited": "--verbose"},
        {"first_line": f"megatron-packing train: starting with {missing}", "verbose": True,
         "verbose_flag": "--verbose", "inherited": None}]
    assert warnings.showwarning is before and INHERIT_ENV not in os.environ
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"megatron-packing train: starting with {missing}"


def test_the_entry_point_flag(shown, tmp_path, monkeypatch, capsys):
    import argparse

    from megatron_packing.megatron_lm.__main__ import VERBOSE_FLAG, start
    from megatron_packing.megatron_lm.arguments import add_packing_arguments

    parsed = add_packing_arguments(argparse.ArgumentParser()).parse_args(
        ["--packing-config", "x.yaml", VERBOSE_FLAG])
    assert parsed.packing_verbose is True
    monkeypatch.setenv("WORLD_SIZE", "8")
    start(["--packing-config", "x.yaml", VERBOSE_FLAG])
    _emit(tmp_path / "site-packages", *REAL_WARNINGS[0])
    assert shown == [REAL_WARNINGS[0][1]]
    start(["--packing-config", "x.yaml"])
    _emit(tmp_path / "site-packages", *REAL_WARNINGS[1])
    quiet_start.report("> ")
    assert shown == [REAL_WARNINGS[0][1]]
    assert capsys.readouterr().out.splitlines() == [
        "megatron_packing.megatron_lm: starting Megatron-LM on 8 ranks"] * 2 + [
        "> (hid 1 known third-party start-up warning: Transformer Engine and Apex not "
        "installed; --packing-verbose shows them)"]


def _known_texts_in(output: str) -> list[str]:
    return [m.group(0) for entry in KNOWN_WARNINGS
            for m in [re.search(entry.pattern.removeprefix("^"), output)] if m]


@pytest.mark.slow
def test_the_demo_prints_its_first_line_before_any_third_party_warning(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (INHERIT_ENV, "PYTHONWARNINGS")}
    done = subprocess.run(
        [sys.executable, "-m", "megatron_packing.cli", "train", "--config",
         "configs/demo_cpu.yaml", "--steps", "1", "--output-dir", str(tmp_path / "run"),
         "--no-wandb"],
        cwd=REPO, env={**env, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
                       "WANDB_MODE": "disabled"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "megatron-packing train: starting with configs/demo_cpu.yaml"
    assert _known_texts_in(done.stdout) == []
    collapsed = [line for line in lines if "known third-party start-up warning" in line]
    assert len(collapsed) == 1, collapsed  # rank 0 only
    assert re.fullmatch(r"\[train\] \(hid \d+ known third-party start-up warnings: Transformer "
                        r"Engine and Apex not installed, .*; --verbose shows them\)",
                        collapsed[0])
