"""The supported megatron-core range, refused outside it when the Megatron-LM entry point is
imported, and the seam's answers for the installed release."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_packing.megatron import compat

PROJECT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version", [(0, 16, 0), (0, 16, 1), (0, 17, 0), (0, 19, 2), (0, 19, 9)])
def test_versions_in_the_range_are_accepted(version):
    assert compat.unsupported_reason(version) is None


@pytest.mark.parametrize("version", [(0, 15, 3), (0, 20, 0), (1, 0, 0), (0, 9, 16)])
def test_versions_outside_the_range_name_the_version_and_the_range(version):
    reason = compat.unsupported_reason(version)
    assert reason is not None
    assert f"megatron-core {'.'.join(map(str, version))} is not supported" in reason
    assert ">= 0.16, < 0.20" in reason


def test_the_installed_megatron_core_is_supported():
    assert compat.unsupported_reason(compat.megatron_core_version()) is None


def test_refusal_is_one_line_on_rank_0_and_exit_status_2(monkeypatch, capsys):
    monkeypatch.setattr(compat, "megatron_core_version", lambda: (0, 21, 0))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as refused:
        compat.refuse_unsupported_megatron_core()
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("megatron_packing.megatron_lm: error: megatron-core 0.21.0 is not "
                          "supported; this megatron_packing supports megatron-core >= 0.16, < 0.20")
    monkeypatch.setenv("RANK", "1")  # every rank stops; only rank 0 says why
    with pytest.raises(SystemExit):
        compat.refuse_unsupported_megatron_core()
    assert capsys.readouterr().err == ""


def test_a_supported_release_passes(monkeypatch, capsys):
    monkeypatch.setattr(compat, "megatron_core_version", lambda: (0, 19, 2))
    compat.refuse_unsupported_megatron_core()
    assert capsys.readouterr().err == ""


def test_the_wheel_ships_megatron_training_from_0_19():
    assert not compat.ships_training((0, 16, 1))
    assert compat.ships_training((0, 19, 2))


def test_the_seam_matches_the_installed_release():
    """0.16 has megatron-core's THD CP slicer and no row-level PackedSeqParams fields; 0.19
    the reverse."""
    fields = compat.packed_seq_params_fields()
    new = {"total_tokens", "seq_idx", "tokens_per_sample", "pad_between_seqs"}
    if compat.megatron_core_version()[:2] >= (0, 19):
        assert new <= fields
        assert compat.thd_cp_slicer() is None
    else:
        assert not new & fields
        assert compat.thd_cp_slicer() is not None


@pytest.mark.slow
def test_importing_the_entry_point_refuses_an_unsupported_release_without_a_traceback():
    code = ("import megatron_packing.megatron.compat as c\n"
            "c.megatron_core_version = lambda: (0, 15, 2)\n"
            "import megatron_packing.megatron_lm.entry\n"
            "print('imported')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PROJECT),
                                                        os.environ.get("PYTHONPATH", "")])}
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=180)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "imported" not in proc.stdout
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors == ["megatron_packing.megatron_lm: error: megatron-core 0.15.2 is not "
                      "supported; this megatron_packing supports megatron-core >= 0.16, < 0.20 "
                      "(tested: 0.16.1 on Python 3.11, 0.19.2 on Python 3.12). Install a "
                      "supported release (pip install 'megatron-core>=0.16,<0.20'; 0.19 needs "
                      "Python >= 3.12)"]
