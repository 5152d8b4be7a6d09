"""The entry point's quiet first run, under torchrun: global rank 0 prints the program's first line
before Megatron's output, and the known harmless third-party warnings collapse into one line from
rank 0 (tests/startup/test_quiet_start.py holds the fast tests, unknown warnings among them)."""

from __future__ import annotations

import re
import subprocess

import pytest
from megatron_lm_runs import _env, requires_megatron_lm, torchrun_command, write_sft_yaml

from megatron_packing.common.quiet_start import INHERIT_ENV, KNOWN_WARNINGS

pytestmark = [pytest.mark.slow, requires_megatron_lm]


def _launch(args: list[str]) -> str:
    """stdout and stderr of every process of the launch, merged in the order written."""
    env = {k: v for k, v in _env().items() if k not in (INHERIT_ENV, "PYTHONWARNINGS")}
    done = subprocess.run(torchrun_command(2, args), env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:]
    return done.stdout


def test_first_line_first_and_known_warnings_collapsed(sft_data, tmp_path):
    yaml = write_sft_yaml(tmp_path / "sft.yaml", sft_data)
    output = _launch(["--packing-config", str(yaml), "--global-batch-size", "16",
                      "--train-iters", "4"])
    first = "megatron_packing.megatron_lm: starting Megatron-LM on 2 ranks"
    assert output.count(first) == 1  # rank 0 only
    known = [m.start() for entry in KNOWN_WARNINGS
             for m in [re.search(entry.pattern.removeprefix("^"), output)] if m]
    assert known == []
    assert output.index(first) < output.index("using world size")  # before Megatron's own
    collapsed = re.findall(r"^> \(hid \d+ known third-party start-up warnings: .*\)$", output,
                           re.MULTILINE)
    assert len(collapsed) == 1, output[-4000:]
    assert "Transformer Engine and Apex not installed" in collapsed[0]
    assert collapsed[0].endswith("; --packing-verbose shows them)")
