"""``simulate --config``, ``tune`` and ``inspect --with-data`` on a training YAML's own data."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_packing.cli import main
from megatron_packing.data import load_sft_dataset
from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler
from megatron_packing.reports.progress import progress_enabled
from megatron_packing.stream.base_order import SeededRandomOrder

from .conftest import write_config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def direct_run(lengths, *, align: bool, steps: int, dp: int = 2) -> list[tuple[int, int, int]]:
    """(examples, bins, padding bins) per step of the sampler built by hand from the YAML's keys."""
    sampler = DPAlignedPackingBatchSampler(
        SeededRandomOrder(len(lengths), 7), lengths, 16, dp, bin_capacity=256,
        allowed_variation=0.25, total_steps=steps, oversize_policy="truncate", align_to_dp=align,
        seed=7)
    out = []
    while len(out) < steps:
        out += [(b.plan.num_examples, b.plan.num_bins, b.plan.padding_bins) for b in sampler]
    return out


@pytest.mark.slow
def test_simulate_config_writes_the_png_and_a_json_equal_to_a_direct_sampler_run(
        report_data, tmp_path, capsys):
    config = write_config(tmp_path / "sft.yaml", report_data)
    out = tmp_path / "out"
    assert main(["simulate", "--config", str(config), "--dp-size", "2", "--steps", "30",
                 "--output-dir", str(out)]) == 0
    printed = capsys.readouterr()
    assert printed.err == ""  # no progress bar off a terminal
    document = json.loads((out / "simulate.json").read_text())
    assert (out / "simulate.png").read_bytes()[:8] == PNG_MAGIC

    ds = load_sft_dataset(report_data["data"], str(report_data["tokenizer"]),
                          cache_dir=tmp_path / "cache", show_progress=False)
    assert document["dataset"]["examples"] == len(ds) == 240
    assert document["dataset"]["index_paths"] == ds.index_paths  # the YAML's cache_dir was used
    lengths = np.asarray(ds.lengths)
    for label, align in (("fixed", False), ("aligned", True)):
        expected = direct_run(lengths, align=align, steps=30)
        per_step = document[label]["per_step"]
        got = list(zip(per_step["batch_size"], per_step["bins"], per_step["padding_bins"],
                       strict=True))
        assert got == expected
        summary = document[label]["summary"]
        assert summary["bins"] == sum(b for _, b, _ in expected)
        assert summary["padding_bins"] == sum(p for _, _, p in expected)
    assert document["fixed"]["summary"]["batch_size_min"] == 16 == document["fixed"]["summary"]["batch_size_max"]
    assert document["aligned"]["summary"]["padding_bins"] < document["fixed"]["summary"]["padding_bins"]
    table = printed.out
    assert f"| bins | {document['fixed']['summary']['bins']:,} | " in table
    assert f"| padding bins | {document['fixed']['summary']['padding_bins']:,} | " in table
    fixed_s, aligned_s = document["fixed"]["summary"], document["aligned"]["summary"]
    assert (f"| its least with these bins (any hand-out) | "
            f"{fixed_s['step_time_imbalance_bound']:.4f} | "
            f"{aligned_s['step_time_imbalance_bound']:.4f} |") in table
    assert (f"| modeled run time vs fixed B (slowest ranks summed) | 1.0000 | "
            f"{aligned_s['modeled_time'] / fixed_s['modeled_time']:.4f} |") in table


def test_simulate_config_takes_dp_and_steps_from_the_train_section(report_data, tmp_path, capsys):
    config = write_config(tmp_path / "train.yaml", report_data, train={"dp_size": 4, "steps": 12})
    assert main(["simulate", "--config", str(config), "--output-dir", str(tmp_path / "o"),
                 "--no-plot", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["dp_size"] == 4 and document["steps"] == 12
    assert all(b % 4 == 0 for b in document["aligned"]["per_step"]["bins"])
    assert not (tmp_path / "o" / "simulate.png").exists()


def test_simulate_config_charges_full_rows_when_rows_are_padded(report_data, tmp_path, capsys):
    summaries, tables = {}, {}
    for padded in (False, True):
        config = write_config(tmp_path / f"sft_{padded}.yaml", report_data,
                              packing={"pad_bins_to_capacity": padded})
        out = tmp_path / f"o_{padded}"
        assert main(["simulate", "--config", str(config), "--dp-size", "2", "--steps", "10",
                     "--output-dir", str(out), "--no-plot"]) == 0
        tables[padded] = capsys.readouterr().out
        document = json.loads((out / "simulate.json").read_text())
        summaries[padded] = {k: document[k]["summary"] for k in ("fixed", "aligned", "dp_balanced")}
    table = tables[True]
    bins = next(line for line in table.splitlines() if line.startswith("| bins | "))
    change = bins.split("(", 1)[1].split(")")[0]
    assert f"fewer bins are faster outright ({change} in bins)" in table
    assert "pad_bins_to_capacity is on" not in tables[False]
    for label in ("fixed", "aligned", "dp_balanced"):
        plain, rows = summaries[False][label], summaries[True][label]
        assert rows["bins"] == plain["bins"]  # the same plans: only the model charges rows
        # Every bin's linear work becomes the whole row: at least its tokens, more with room.
        assert rows["modeled_time"] > plain["modeled_time"]


def test_simulate_config_shows_megatron_lm_s_dp_balanced_beside_fixed_b(report_data, tmp_path,
                                                                        capsys):
    config = write_config(tmp_path / "sft.yaml", report_data,
                          packing={"microbatch_cost_tokens": 500})
    out = tmp_path / "o"
    assert main(["simulate", "--config", str(config), "--dp-size", "2", "--steps", "12",
                 "--output-dir", str(out), "--no-plot"]) == 0
    table = capsys.readouterr().out
    document = json.loads((out / "simulate.json").read_text())
    fixed, reference = document["fixed"], document["dp_balanced"]
    assert reference["per_step"]["batch_size"] == fixed["per_step"]["batch_size"]
    assert all(b % 2 == 0 for b in reference["per_step"]["bins"])
    assert "| measure | fixed B | aligned | dp_balanced (Megatron-LM) |" in table
    s = reference["summary"]
    assert f"| {s['bins']:,} |" in next(line for line in table.splitlines()
                                       if line.startswith("| bins | "))
    assert "0.0 per micro-batch" not in table and "500 per micro-batch" in table


@pytest.mark.parametrize("packing,argv,message", [
    ({}, [], "no train.dp_size in the YAML; give the data-parallel size with --dp-size N"),
    ({"bin_capacity": 64, "oversize_policy": "error"}, ["--dp-size", "2"],
     "cannot plan with bin_capacity=64"),
    ({"packing_batch_size_allowed_variation": 0.01}, ["--dp-size", "2"],
     "gives a window of floor(16 x 0.01) = 0 examples"),
])
def test_simulate_config_errors_name_the_setting(report_data, tmp_path, capsys, packing, argv,
                                                 message):
    config = write_config(tmp_path / "sft.yaml", report_data, packing=packing)
    assert main(["simulate", "--config", str(config), *argv, "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-packing simulate: error: ") and message in err


@pytest.mark.slow
def test_tune_runs_the_grid_and_recommends_a_point_that_ran(report_data, tmp_path, capsys):
    config = write_config(tmp_path / "sft.yaml", report_data)
    out = tmp_path / "out"
    assert main(["tune", "--config", str(config), "--dp-size", "2", "--steps", "10",
                 "--capacities", "128", "256", "--variations", "0.05", "0.25",
                 "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "tune.json").read_text())
    assert (out / "tune.png").read_bytes()[:8] == PNG_MAGIC
    assert {(p["bin_capacity"], p["variation"]) for p in report["points"]} == {
        (128, 0.05), (128, 0.25), (256, 0.05), (256, 0.25)}
    no_window = [p for p in report["points"] if p["variation"] == 0.05]
    assert all("v = floor(16 x 0.05) = 0" in p["problem"] for p in no_window)
    ran = [p for p in report["points"] if p["problem"] is None]
    assert report["recommended"] in ran
    assert all(p["modeled_per_1000"] > 0 for p in ran)
    assert "| modeled time / 1,000 examples (K) |" in printed
    assert set(report["fixed"]) == {"128", "256"}
    assert "Recommendation: align_packing_bins_to_dp: true, bin_capacity: " in printed
    assert report["reasons"] and all(r in printed for r in report["reasons"])


def test_inspect_with_data_counts_skipped_records_in_the_configured_cache(report_data, tmp_path,
                                                                           capsys):
    bad = tmp_path / "bad.jsonl"
    lines = report_data["data"].read_text().splitlines()
    lines[4] = '{"messages": ['
    bad.write_text("\n".join(lines) + "\n")
    config = write_config(tmp_path / "sft.yaml", report_data,
                          data={"paths": [str(bad)], "on_bad_record": "skip"})
    assert main(["inspect", "--config", str(config), "--with-data", "--dp-size", "2",
                 "--output-dir", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "dataset: 239 examples" in out
    assert "skipped bad records (skip): 1 (malformed_json=1)" in out
    assert f"length index: {tmp_path / 'cache'}" in out
    assert (tmp_path / "o" / "lengths.png").read_bytes()[:8] == PNG_MAGIC

    config = write_config(tmp_path / "sft.yaml", report_data,
                          data={"paths": [str(bad)], "on_bad_record": "error"})
    assert main(["inspect", "--config", str(config), "--with-data", "--dp-size", "2",
                 "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:5: bad record (malformed_json)" in err


def test_progress_bars_only_on_a_terminal_and_never_with_quiet(monkeypatch):
    class Terminal:
        def __init__(self, tty: bool) -> None:
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    monkeypatch.setattr("sys.stderr", Terminal(True))
    assert progress_enabled() and not progress_enabled(quiet=True)
    monkeypatch.setattr("sys.stderr", Terminal(False))
    assert not progress_enabled()


def test_without_matplotlib_the_json_is_written_and_the_missing_png_is_said(
        report_data, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib.figure", None)  # import fails
    config = write_config(tmp_path / "sft.yaml", report_data)
    assert main(["simulate", "--config", str(config), "--dp-size", "2", "--steps", "3",
                 "--output-dir", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert "warning: the PNG report needs matplotlib: pip install 'megatron_packing[plots]'" in err
    assert (tmp_path / "o" / "simulate.json").is_file()
    assert not (tmp_path / "o" / "simulate.png").exists()
