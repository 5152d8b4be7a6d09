"""``simulate`` on the length pools: the runs and the offline best paths, as JSON and as a table."""

from __future__ import annotations

import json

import pytest

from megatron_packing.cli import main
from megatron_packing.common.validation import allowed_batch_variation
from megatron_packing.packing.reference import contiguous_path_bounds
from megatron_packing.reports.pools import find_pool_dir, load_pools, pool_stream

B, CAPACITY, DP, STEPS = 64, 2048, 2, 8
ARGS = ["simulate", "--pool", "gsm8k", "--batch-size", str(B), "--capacity", str(CAPACITY),
        "--dp-size", str(DP), "--steps", str(STEPS), "--no-exhaustive"]


def _json(capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    assert main([*ARGS, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_json_gives_both_offline_paths_as_the_programme_finds_them(capsys):
    document = _json(capsys)
    lengths = pool_stream(load_pools(find_pool_dir()), "gsm8k", STEPS * B, CAPACITY, seed=0)
    aligned, fewest = contiguous_path_bounds(lengths, batch_size=B, capacity=CAPACITY, dp_size=DP,
                                             v=allowed_batch_variation(B, 0.05), steps=STEPS)
    assert document["best_contiguous_paths"] == {"aligned_steps": aligned, "fewest_bins": fewest}
    # Fixed B is one admissible path (every boundary at its nominal place): no better than either.
    fixed = document["fixed B"]
    assert fewest <= fixed["bins"] and aligned >= fixed["aligned_steps"]
    assert aligned >= document["aligned"]["aligned_steps"]


def test_the_table_shows_the_fewest_bins_and_the_aligned_share_in_the_offline_column(capsys):
    best = _json(capsys)["best_contiguous_paths"]
    assert main(ARGS) == 0
    cells = [[cell.strip() for cell in line.strip()[1:-1].split("|")]
             for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    rows = {row[0]: row for row in cells}
    assert rows["measure"][-1] == "best contiguous paths (offline)"
    assert rows["bins"][-1].startswith(f"{best['fewest_bins']:,} (")
    assert rows["steps aligned to dp"][-1] == f"{best['aligned_steps'] / STEPS:.1%}"
    assert rows["token fill"][-1] == ""


def test_no_ceiling_leaves_out_the_offline_paths(capsys):
    assert "best_contiguous_paths" not in _json(capsys, "--no-ceiling")
    assert main([*ARGS, "--no-ceiling"]) == 0
    assert "offline" not in capsys.readouterr().out


def test_the_table_shows_the_imbalance_bound_and_the_run_time_against_fixed_b(capsys):
    # Long documents at dp 8: the aligned run's bins, balance and run time differ from fixed
    # B's, so a row swapped with another or a ratio inverted shows.
    args = ["simulate", "--pool", "leval_pairs", "--batch-size", "64", "--capacity", "8192",
            "--dp-size", "8", "--steps", "8", "--no-exhaustive", "--no-ceiling"]
    assert main([*args, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    fixed, aligned = document["fixed B"], document["aligned"]
    ratio = aligned["modeled_time"] / fixed["modeled_time"]
    assert f"{ratio:.4f}" != "1.0000"
    assert f"{aligned['step_time_imbalance_bound']:.4f}" != f"{aligned['step_time_imbalance']:.4f}"
    assert main(args) == 0
    cells = [[cell.strip() for cell in line.strip()[1:-1].split("|")]
             for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    rows = {row[0]: row for row in cells}
    assert rows["measure"][1:3] == ["fixed B", "aligned"]
    assert rows["its least with these bins (any hand-out)"][1:3] == [
        f"{fixed['step_time_imbalance_bound']:.4f}", f"{aligned['step_time_imbalance_bound']:.4f}"]
    assert rows["modeled run time vs fixed B"][1:3] == ["1.0000", f"{ratio:.4f}"]
    assert 1.0 - 1e-9 <= aligned["step_time_imbalance_bound"] <= aligned["step_time_imbalance"]


def test_dp_balanced_runs_fixed_b_s_steps_as_megatron_lm_would(capsys):
    # Every step holds exactly B examples (fixed B's), next-fit: more bins than fixed B's packer,
    # bin k on rank k mod dp; every run is timed by the same model.
    document = _json(capsys)
    reference, fixed = document["dp_balanced"], document["fixed B"]
    assert reference["examples"] == fixed["examples"] == STEPS * B
    assert (reference["min_batch"], reference["max_batch"]) == (B, B)
    assert reference["bins"] >= fixed["bins"] - fixed["padding_bins"]
    lengths = pool_stream(load_pools(find_pool_dir()), "gsm8k", STEPS * B, CAPACITY, seed=0)
    from megatron_packing.packing.dp_balanced import plan_step
    from megatron_packing.packing.step_time import rank_times

    plans = [plan_step(lengths[s * B:(s + 1) * B], CAPACITY, DP) for s in range(STEPS)]
    assert reference["bins"] == sum(len(p.bins) for p in plans)
    assert reference["padding_bins"] == sum(p.extra_bins for p in plans)
    slowest = [rank_times([[int(lengths[s * B + i]) for i in b] for b in p.bins],
                          p.rank_bins).max() for s, p in enumerate(plans)]
    assert reference["modeled_time"] == pytest.approx(sum(slowest))


def test_a_micro_batch_cost_is_charged_in_every_run(capsys):
    plain = _json(capsys)
    charged = _json(capsys, "--microbatch-cost-tokens", "5000")
    for label in ("fixed B", "aligned", "dp_balanced"):
        # The same bins here, plus 5000 per micro-batch on the slowest rank of every step (the
        # aligned run's hand-out weighs its ranks against a mean that includes the cost, so it
        # may leave a step's ranks a few tokens apart otherwise).
        assert charged[label]["bins"] == plain[label]["bins"], label
        per_rank = charged[label]["bins"] / DP
        assert charged[label]["modeled_time"] == pytest.approx(
            plain[label]["modeled_time"] + 5000 * per_rank, rel=1e-4), label
