"""TP, CP and PP through Megatron-LM's loop on CPU (gloo), 2 ranks each, data-parallel size 1.

With one DP rank every layout trains the same global batches as a single-process run. The rows
differ (TP and CP change the alignment rules, so the same examples pack differently), but the
loss of a step does not depend on the packing: TP = 2 and CP = 2 must reproduce its losses. PP = 2 seeds its second stage differently (Megatron adds
100 x the pipeline rank to the seed), so its check is that rows padded to the step's longest
row train exactly as rows padded to the full capacity.
"""

from __future__ import annotations

import pytest
from megatron_lm_runs import launch, requires_megatron_lm, write_sft_yaml

pytestmark = [requires_megatron_lm, pytest.mark.slow]

ITERS = 3


def _run(tmp_path_factory, sft_data, name: str, nproc: int, *extra: str, **packing):
    tmp = tmp_path_factory.mktemp(name)
    yaml = write_sft_yaml(tmp / "sft.yaml", sft_data, **packing)
    run = launch(nproc, ["--packing-config", str(yaml), "--global-batch-size", "16",
                         "--train-iters", str(ITERS), *extra], tmp / "log")
    assert run.returncode == 0, run.output[-4000:]
    return run


@pytest.fixture(scope="module")
def single(sft_data, tmp_path_factory):
    return _run(tmp_path_factory, sft_data, "single", 1)


@pytest.fixture(scope="module")
def pipeline(sft_data, tmp_path_factory):
    return _run(tmp_path_factory, sft_data, "pp", 2, "--pipeline-model-parallel-size", "2")


def _examples(step: dict) -> list[int]:
    return sorted(e for row in step["examples"] for e in row)


def _same_plan_on_every_rank(run, nranks: int) -> list[dict]:
    steps = [run.steps(rank) for rank in range(nranks)]
    for other in steps[1:]:
        assert [(s["examples"], s["micro_batches"], s["seq_length"]) for s in other] == \
            [(s["examples"], s["micro_batches"], s["seq_length"]) for s in steps[0]]
    return steps[0]


@pytest.mark.parametrize("layout", ["--tensor-model-parallel-size", "--context-parallel-size"])
def test_tp2_and_cp2_reproduce_the_single_process_run(single, sft_data, tmp_path_factory, layout):
    run = _run(tmp_path_factory, sft_data, layout.strip("-")[:2], 2, layout, "2")
    steps = _same_plan_on_every_rank(run, 2)
    reference = single.steps(0)
    assert [_examples(s) for s in steps] == [_examples(s) for s in reference]
    assert len({s["micro_batches"] for s in steps}) > 1
    for got, want in zip(steps, reference, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert got["lr"] == want["lr"]


def test_pp2_every_stage_gets_the_plan_and_rows_pad_to_the_longest(pipeline, single):
    steps = _same_plan_on_every_rank(pipeline, 2)
    assert [_examples(s) for s in steps] == [_examples(s) for s in single.steps(0)]
    assert all(s["loss"] is None for s in pipeline.steps(0)), "first stage reports no loss"
    assert all(s["loss"] is not None for s in pipeline.steps(1))
    for s in steps:  # the schedule gets the step's longest row; shorter rows are padded to it
        assert s["seq_length"] == max(s["row_lengths"]) <= 256
    assert any(min(s["row_lengths"]) < s["seq_length"] for s in steps), "no row was padded"


def test_pp2_longest_row_padding_trains_as_capacity_padding(pipeline, sft_data,
                                                            tmp_path_factory):
    padded = _run(tmp_path_factory, sft_data, "pp_capacity", 2,
                  "--pipeline-model-parallel-size", "2", pad_bins_to_capacity=True)
    assert all(s["seq_length"] == 256 for s in padded.steps(1))
    for got, want in zip(pipeline.steps(1), padded.steps(1), strict=True):
        assert got["examples"] == want["examples"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
