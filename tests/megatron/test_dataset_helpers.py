"""megatron-core's dataset helpers at start-up: no make where they import; built once where they
do not and can be; one clear error on every rank where they neither import nor build."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from megatron_packing.megatron import dataset_helpers  # noqa: E402
from megatron_packing.megatron.dataset_helpers import (  # noqa: E402
    HELPERS_MODULE,
    DatasetHelpersUnavailable,
    ensure_dataset_helpers,
    use_prebuilt_helpers,
)


def failing_make(folder: Path) -> Path:
    """A ``make`` that records each call and always fails, first on PATH."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "make"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {folder / 'calls'}\nexit 2\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return folder / "calls"


def test_helpers_that_import_are_not_built_and_megatrons_compile_step_runs_no_make(
        tmp_path, monkeypatch):
    from megatron.core.datasets import utils

    calls = failing_make(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(utils, "compile_helpers", utils.compile_helpers)
    ensure_dataset_helpers()
    use_prebuilt_helpers()
    use_prebuilt_helpers()  # idempotent: wrapped once
    utils.compile_helpers()  # what initialize_megatron calls on global rank 0
    assert not calls.exists()
    assert utils.compile_helpers.__wrapped__.__module__ == "megatron.core.datasets.utils"


def test_megatrons_own_compile_step_fails_on_the_wheel_without_the_replacement(tmp_path,
                                                                             monkeypatch):
    """What the replacement prevents: make runs, fails (no Makefile), and the rank exits."""
    from megatron.core.datasets import utils

    calls = failing_make(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    original = getattr(utils.compile_helpers, "__wrapped__", utils.compile_helpers)
    with pytest.raises(SystemExit):
        original()
    assert calls.read_text().startswith("-C ")


def test_helpers_that_neither_import_nor_build_raise_naming_cause_and_fix(tmp_path, monkeypatch):
    failing_make(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setitem(sys.modules, HELPERS_MODULE, None)  # import fails
    with pytest.raises(DatasetHelpersUnavailable) as caught:
        ensure_dataset_helpers()
    message = str(caught.value)
    assert HELPERS_MODULE in message and "do not import" in message
    assert "no Makefile" in message  # the wheel ships none
    assert "pip install --force-reinstall --no-deps 'megatron-core==" in message
    assert "\n" not in message


def _fake_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, makefile: str) -> Path:
    """A datasets folder with ``makefile``; the helpers 'import' once a file ``built`` exists."""
    folder = tmp_path / "datasets"
    folder.mkdir()
    (folder / "Makefile").write_text(makefile)
    monkeypatch.setattr(dataset_helpers, "datasets_folder", lambda: folder)
    monkeypatch.setattr(dataset_helpers, "import_error",
                        lambda: None if (folder / "built").exists() else "ImportError: none yet")
    return folder


def test_helpers_missing_from_a_source_install_are_built_once_with_its_makefile(tmp_path,
                                                                               monkeypatch):
    folder = _fake_install(tmp_path, monkeypatch,
                           "default:\n\techo run >> runs\n\ttouch built\n")
    lines: list[str] = []
    ensure_dataset_helpers(lines.append)
    ensure_dataset_helpers(lines.append)  # a second rank: they import now, nothing is built
    assert (folder / "runs").read_text().splitlines() == ["run"]
    assert lines == [f"building megatron-core's dataset helpers in {folder} with make"]


def test_a_failing_build_is_reported_with_makes_last_lines(tmp_path, monkeypatch):
    folder = _fake_install(tmp_path, monkeypatch,
                           "default:\n\t@echo 'helpers.cpp: fatal error: pybind11.h: No such "
                           "file' >&2\n\t@exit 1\n")
    with pytest.raises(DatasetHelpersUnavailable) as caught:
        ensure_dataset_helpers(lambda line: None)
    message = str(caught.value)
    assert f"make -C {folder} exited 2" in message
    assert "pybind11.h: No such file" in message


def test_make_missing_from_path_is_named(tmp_path, monkeypatch):
    _fake_install(tmp_path, monkeypatch, "default:\n\ttouch built\n")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(DatasetHelpersUnavailable, match="`make` is not on PATH"):
        ensure_dataset_helpers(lambda line: None)


def test_the_legacy_fused_kernel_load_is_skipped_only_without_nvcc(monkeypatch, capsys):
    from types import SimpleNamespace

    from megatron_packing.megatron_lm import startup

    loaded: list[object] = []
    load = startup.fused_kernels_load_without_toolkit(loaded.append)
    args = SimpleNamespace(rank=0)
    monkeypatch.setattr(startup, "nvcc_path", lambda: None)
    load(args)
    assert loaded == []
    assert "no CUDA toolkit (nvcc) found" in capsys.readouterr().out
    monkeypatch.setattr(startup, "nvcc_path", lambda: "/usr/local/cuda/bin/nvcc")
    load(args)
    assert loaded == [args]
