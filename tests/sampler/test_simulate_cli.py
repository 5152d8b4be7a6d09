"""``megatron-packing simulate``: its columns, and clear errors for bad sizes."""

from __future__ import annotations

import pytest

from megatron_packing.cli import main


def test_simulate_prints_the_exhaustive_reference_and_the_offline_best_path(capsys):
    assert main(["simulate", "--steps", "4", "--batch-size", "16", "--capacity", "512",
                 "--dp-size", "2", "--variation", "0.2", "--max-deferred", "2"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| measure"))
    assert header == ("| measure | fixed B | exhaustive | aligned | aligned, defer <= 2 "
                      "| dp_balanced | best contiguous paths (offline) |")
    rows = {cells[0]: cells for cells in (
        [cell.strip() for cell in line.strip()[1:-1].split("|")]
        for line in out.splitlines() if line.startswith("| "))}
    offline = rows["measure"].index("best contiguous paths (offline)")
    assert rows["steps aligned to dp"][offline].endswith("%")  # the most aligned steps' share
    assert rows["bins"][offline].endswith("% vs fixed B)")  # the fewest bins
    assert rows["token fill"][offline] == ""
    assert "| packer runs / step |" in out


@pytest.mark.parametrize("argv,message", [
    (["--variation", "1.5"], "--variation must be a number in (0, 1), got 1.5"),
    (["--variation", "0"], "--variation must be a number in (0, 1), got 0.0"),
    (["--variation", "x"], "--variation must be a number in (0, 1), got 'x'"),
    (["--capacity", "8"], "--capacity must be an integer >= 16, got 8"),
    (["--capacity", "4k"], "--capacity must be an integer, got '4k'"),
    (["--dp-size", "0"], "--dp-size must be an integer >= 1, got 0"),
    (["--batch-size", "16", "--variation", "0.05"], "gives a window of floor(16 x 0.05) = 0"),
    (["--max-deferred", "-1"], "--max-deferred must be an integer >= 0, got -1"),
    (["--microbatch-cost-tokens", "-5"], "--microbatch-cost-tokens must be a number >= 0, got -5"),
    (["--microbatch-cost-tokens", "x"], "--microbatch-cost-tokens must be a number >= 0, got 'x'"),
])
def test_simulate_rejects_bad_arguments_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as raised:
        main(["simulate", *argv])
    assert raised.value.code == 2
    assert message in capsys.readouterr().err
