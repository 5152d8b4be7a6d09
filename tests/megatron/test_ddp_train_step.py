"""The train step on megatron-core DistributedDataParallel + optimizer, 2 gloo ranks, float64.

Packed and one-example-per-row batches must give the loss and the finalized ``main_grad`` of a
single process over the whole global batch (so the DDP really reduced), on both ranks; after
the megatron-core optimizer step both ranks hold identical parameters.
"""

from __future__ import annotations

import pytest
import torch


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from ddp_workers import SETUPS, ddp_train_steps

    from megatron_packing.demo.launch import spawn_data_parallel

    out = tmp_path_factory.mktemp("ddp")
    spawn_data_parallel(ddp_train_steps, 2, str(out))
    return {name: [torch.load(out / f"{name}_rank{r}.pt", weights_only=False) for r in range(2)]
            for name, _, _ in SETUPS}


SETUP_NAMES = ("distopt_overlap", "ddp")


@pytest.mark.slow
@pytest.mark.parametrize("setup", SETUP_NAMES)
def test_packed_equals_unpacked_equals_reference(runs, setup):
    from ddp_workers import STEP_SIZES

    ranks = runs[setup]
    assert ranks[0]["param_dtype"] == ranks[0]["grad_dtype"] == "torch.float64"
    records = ranks[0]["records"]
    assert len(records) == len(STEP_SIZES)
    assert len({r["micro_batches"] for r in records}) > 1  # the micro-batch count varies
    assert any(r["placeholders"] for rank in ranks for r in rank["records"])
    for rank in ranks:
        for rec in rank["records"]:
            assert rec["loss_packed"] == pytest.approx(rec["loss_ref"], rel=1e-9)
            assert rec["loss_unpacked"] == pytest.approx(rec["loss_ref"], rel=1e-9)
            assert rec["step_loss"] == pytest.approx(rec["loss_ref"], rel=1e-9)
            assert float(rec["grad_ref"].norm()) > 0
            assert _rel(rec["grad_packed"], rec["grad_ref"]) <= 1e-6
            assert _rel(rec["grad_unpacked"], rec["grad_ref"]) <= 1e-6
            # The optimizer's own norm is that of the reduced global gradient.
            assert rec["step_grad_norm"] == pytest.approx(float(rec["grad_ref"].norm()), rel=1e-6)
            assert rec["update_successful"]


@pytest.mark.slow
@pytest.mark.parametrize("setup", SETUP_NAMES)
def test_ranks_agree_on_gradients_and_parameters(runs, setup):
    first, second = (rank["records"] for rank in runs[setup])
    for a, b in zip(first, second, strict=True):
        assert _rel(a["grad_packed"], b["grad_packed"]) <= 1e-12
        assert torch.equal(a["params_after"], b["params_after"])
    # The weights moved, so later steps compared gradients at new points.
    assert not torch.equal(first[0]["params_after"], first[-1]["params_after"])


@pytest.mark.slow
def test_overlap_setup_reduces_in_several_buckets(runs):
    assert runs["distopt_overlap"][0]["buckets"] > 1


@pytest.mark.slow
@pytest.mark.parametrize("setup", SETUP_NAMES)
def test_torch_optimizer_on_ddp_model_is_refused(runs, setup):
    for rank in runs[setup]:
        assert len(rank["guard_errors"]) == 1
        assert "megatron-core optimizer" in rank["guard_errors"][0]
