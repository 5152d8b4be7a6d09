"""Metric names and values from StepMetadata; JSONL and offline W&B loggers."""

from __future__ import annotations

import time

import pytest

from megatron_packing.common.plan_types import StepMetadata
from megatron_packing.loader.metrics import (
    METRIC_NAMES,
    InMemoryLogger,
    JsonlLogger,
    MetricsLogger,
    read_jsonl,
    step_metrics,
    truncate_jsonl,
)

REQUIRED = ("train/actual_batch_size", "train/actual_num_tokens", "train/loss_tokens",
            "train/bins", "train/padding_bins", "train/token_fill", "train/dp_imbalance",
            "data/plan_ms")


def _meta() -> StepMetadata:
    return StepMetadata(step=3, epoch=1, num_examples=31, num_tokens=4000, num_loss_tokens=1700,
                        num_bins=8, num_padding_bins=1, num_placeholder_bins=2,
                        micro_batches_per_rank=4, token_fill=0.9, dp_imbalance=1.05,
                        plan_ms=2.5, aligned=False)


def test_step_metrics_names_and_values():
    m = step_metrics(_meta(), loss=2.5, lr=1e-3)
    assert set(REQUIRED) <= set(m) and set(METRIC_NAMES) <= set(m)
    assert m["train/actual_batch_size"] == 31  # real examples, never rows
    assert m["train/loss_tokens"] == 1700 and m["train/placeholder_bins"] == 2
    assert m["train/loss"] == 2.5 and m["train/lr"] == 1e-3 and m["train/aligned"] == 0
    assert m["train/evened"] == 0
    evened = _meta()
    evened.evened = True
    assert step_metrics(evened)["train/evened"] == 1


def test_jsonl_and_memory_loggers(tmp_path):
    mem = InMemoryLogger()
    jsonl = JsonlLogger(tmp_path / "m.jsonl")
    for logger in (mem, jsonl):
        assert isinstance(logger, MetricsLogger)
        for step in range(4):
            logger.log({"train/loss": float(step)}, step=step)
        logger.finish()
    assert mem.series("train/loss") == [0.0, 1.0, 2.0, 3.0] and mem.finished
    truncate_jsonl(tmp_path / "m.jsonl", keep_steps_below=2)
    assert [r["step"] for r in read_jsonl(tmp_path / "m.jsonl")] == [0, 1]


@pytest.mark.slow
def test_wandb_logger_offline(tmp_path, monkeypatch):
    from megatron_packing.loader.metrics import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    logger = WandbLogger(project="megatron-packing-test", directory=tmp_path,
                         config={"global_batch_size": 8})
    assert logger.mode == "offline"
    for step in range(3):
        logger.log(step_metrics(_meta(), loss=3.0 - step, lr=1e-3), step=step)
    logger.finish()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    # The wandb service process may still be flushing the run file when finish() returns.
    deadline = time.monotonic() + 60
    while b"train/actual_batch_size" not in runs[0].read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b"train/actual_batch_size" in runs[0].read_bytes()
