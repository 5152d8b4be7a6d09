"""A run is never overwritten: training into a directory that holds one needs a choice."""

from __future__ import annotations

import pytest

from megatron_packing.demo.run_dir import OutputDirHoldsRun, claim_output_dir, run_contents

from .run_faults_helpers import run_cli, tiny_config, train_command, write_config


def fake_run(directory, *, metrics=True, summary=True, checkpoint=True):
    directory.mkdir(parents=True, exist_ok=True)
    if metrics:
        (directory / "metrics.jsonl").write_text('{"step": 0}\n')
    if summary:
        (directory / "summary.json").write_text("{}")
    if checkpoint:
        (directory / "checkpoints" / "step_000003").mkdir(parents=True)
    return directory


@pytest.mark.parametrize("held", [dict(metrics=True, summary=False, checkpoint=False),
                                  dict(metrics=False, summary=True, checkpoint=False),
                                  dict(metrics=False, summary=False, checkpoint=True)])
def test_a_directory_holding_any_part_of_a_run_is_refused(tmp_path, held):
    out = fake_run(tmp_path / "out", **held)
    with pytest.raises(OutputDirHoldsRun, match="holds a run .*pass --resume to continue it, or "
                                                "--overwrite to delete it"):
        claim_output_dir(out, resume=False, overwrite=False)
    assert run_contents(out)  # nothing was touched


def test_resume_keeps_and_overwrite_removes_the_run(tmp_path):
    out = fake_run(tmp_path / "out")
    assert claim_output_dir(out, resume=True, overwrite=False) == []
    assert run_contents(out) == ["metrics.jsonl", "summary.json", "checkpoints/"]
    notes = claim_output_dir(out, resume=False, overwrite=True)
    assert "removed the previous run" in notes[0]
    assert run_contents(out) == []


def test_an_empty_or_new_directory_needs_no_choice(tmp_path):
    (tmp_path / "empty").mkdir()
    assert claim_output_dir(tmp_path / "empty", resume=False, overwrite=False) == []
    assert claim_output_dir(tmp_path / "new", resume=False, overwrite=False) == []


def test_resume_and_overwrite_together_are_refused(tmp_path):
    with pytest.raises(OutputDirHoldsRun, match="exclude each other"):
        claim_output_dir(tmp_path, resume=True, overwrite=True)


@pytest.mark.slow
def test_the_cli_refuses_to_train_over_a_finished_run(tmp_path):
    out = fake_run(tmp_path / "out")
    before = (out / "metrics.jsonl").read_text()
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path))
    result = run_cli(train_command(config, out, "--no-wandb"), timeout=120)
    assert result.returncode == 2, result.stderr
    assert "holds a run (metrics.jsonl, summary.json, checkpoints/)" in result.stderr
    assert "--resume" in result.stderr and "--overwrite" in result.stderr
    assert "Traceback" not in result.stderr
    assert (out / "metrics.jsonl").read_text() == before


@pytest.mark.slow
def test_the_cli_refuses_an_output_path_that_is_a_file(tmp_path):
    out = tmp_path / "out"
    out.write_text("not a directory")
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path))
    result = run_cli(train_command(config, out, "--no-wandb"), timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"output directory {out} is a file" in result.stderr
    assert "Traceback" not in result.stderr
