"""Padded mode trained for real, on torch's FSDP2 and on the replicated backend (gloo processes).

Launches (kept small; each is a few steps of a 1-layer model):
1. one 2-rank worker launch: padded forward/backward on the replicated and the FSDP2 model
   against a per-example reference, step by step (loss and gradients), and, on rank 0, the
   single-process reference of the demo runs below;
2. the demo trainer, padded mode under a token budget whose per-rank schedules differ, on
   ``train.backend: fsdp2`` and on ``megatron_ddp``;
3. the same FSDP2 run with the count agreement switched off (test-only switch): it must fail
   or hang, seen under a short collective timeout and a process timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_packing.loader.metrics import read_jsonl

REPO = Path(__file__).resolve().parents[2]
DEMO_DATA = REPO / "examples" / "data" / "demo_chat.jsonl"
TOKENIZER = REPO / "examples" / "tokenizer"
STEPS = 3
BUDGET = 600  # the two ranks' schedules differ on every step (checked below)
LOSS_REL = 1e-9  # float64 everywhere; measured differences are ~1e-15 (summation order)
GRAD_REL = 1e-9

pytestmark = pytest.mark.slow


def _document(root: Path, backend: str) -> dict:
    data = root / "data.jsonl"
    if not data.exists():
        data.write_text("\n".join(DEMO_DATA.read_text().splitlines()[:24]) + "\n")
    return {
        "packing": {"global_batch_size": 8, "use_sequence_packing": False,
                    "max_tokens_per_microbatch": BUDGET, "seed": 3},
        "data": {"paths": [str(data)], "tokenizer": str(TOKENIZER),
                 "cache_dir": str(root / "cache")},
        "model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
                  "dtype": "float64", "init_seed": 5},
        "train": {"steps": STEPS, "lr": 0.01, "warmup_steps": 1, "dp_size": 2,
                  "checkpoint_every": 100, "backend": backend},
        "logging": {"wandb": False, "plot": False},
    }


def _train(root: Path, backend: str, *, env: dict[str, str] | None = None,
           timeout: float = 600) -> subprocess.CompletedProcess:
    """The demo trainer's command line, in a fresh process (as a user runs it)."""
    config = root / f"{backend}.yaml"
    config.write_text(yaml.safe_dump(_document(root, backend)))
    return subprocess.run(
        [sys.executable, "-m", "megatron_packing.cli", "train", "--config", str(config),
         "--output-dir", str(root / f"run_{backend}"), "--no-wandb", "--overwrite"],
        cwd=REPO, env={**os.environ, "WANDB_MODE": "offline", **(env or {})},
        capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp2")


@pytest.fixture(scope="module")
def worker_results(root):
    """Launch 1: the padded equivalence (rank*.json) and the demo reference (reference.json)."""
    from fsdp2_workers import equivalence_and_reference

    from megatron_packing.demo.launch import spawn_data_parallel

    spawn_data_parallel(equivalence_and_reference, 2, str(root), _document(root, "fsdp2"))
    return root


@pytest.fixture(scope="module")
def demo_runs(root):
    """Launch 2: the demo trainer's padded runs, one per backend."""
    runs = {}
    for backend in ("fsdp2", "megatron_ddp"):
        done = _train(root, backend)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        runs[backend] = root / f"run_{backend}"
    return runs


def test_padded_step_equals_per_example_reference_on_both_backends(worker_results):
    from fsdp2_workers import EXAMPLES, GLOBAL_BATCH

    root = worker_results
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]
    assert len(ranks[0]) == -(-EXAMPLES // GLOBAL_BATCH)
    # The setup this guards: counts vary from step to step, and a step has a dummy.
    assert len({rec["micro_batches"] for rec in ranks[0]}) > 1
    assert any(rec["dummies"] for rank in ranks for rec in rank)
    assert any(len(set(rec["rank_real"])) > 1 for rec in ranks[0])
    assert any(shape[0] > 1 for rank in ranks for rec in rank for shape in rec["block_shapes"])
    for rank in ranks:
        for rec in rank:
            assert rec["loss_plain"] == pytest.approx(rec["loss_ref"], rel=LOSS_REL)
            assert rec["loss_sharded"] == pytest.approx(rec["loss_ref"], rel=LOSS_REL)
            assert rec["grad_rel_plain"] <= GRAD_REL
            assert rec["grad_rel_sharded"] <= GRAD_REL
            assert rec["grad_norm"] > 0
    for rank in ranks:  # float32 FSDP2 (sums in float32; megatron's float32 cross-entropy)
        assert rank[0]["grad_rel_float32_step0"] <= 1e-4
    for a, b in zip(ranks[0], ranks[1], strict=True):
        assert a["micro_batches"] == b["micro_batches"]  # the agreed count


@pytest.mark.parametrize("backend", ["fsdp2", "megatron_ddp"])
def test_demo_padded_run_equals_single_process_reference(worker_results, demo_runs, backend):
    root, runs = worker_results, demo_runs
    reference = json.loads((root / "reference.json").read_text())
    # The budget gives the two ranks different schedules on some step (dummies needed).
    assert any(len(set(counts)) > 1 for counts in reference["plans"])
    records = read_jsonl(runs[backend] / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    losses = [r["train/loss"] for r in records]
    assert losses == pytest.approx(reference["losses"], rel=LOSS_REL)
    assert losses[-1] < losses[0]  # it trained
    summary = json.loads((runs[backend] / "summary.json").read_text())
    agreed = sum(max(counts) for counts in reference["plans"])
    assert summary["model_calls_per_rank"] == [agreed, agreed]
    assert [r["train/micro_batches_per_rank"] for r in records] == [
        max(counts) for counts in reference["plans"]]


def test_fsdp2_without_the_count_agreement_fails_or_hangs(root):
    from megatron_packing.demo.launch import TIMEOUT_ENV
    from megatron_packing.demo.trainer import NO_COUNT_AGREEMENT_ENV

    (root / "off").mkdir()
    try:
        done = _train(root / "off", "fsdp2", timeout=240,
                      env={NO_COUNT_AGREEMENT_ENV: "1", TIMEOUT_ENV: "15"})
    except subprocess.TimeoutExpired as hung:  # the ranks waited on each other for good
        output = hung.stdout.decode() if isinstance(hung.stdout, bytes) else hung.stdout or ""
        assert "[train] dp=2 steps 0->3" in output  # it hung in training, not before it
        return
    assert "[train] dp=2 steps 0->3" in done.stdout, done.stderr[-3000:]  # training started
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    # the rank left waiting times out, or sees its peer's connection close when the peer
    # failed first on the mismatched collective: either way a rank error, never a summary
    assert "error on rank" in done.stderr, done.stderr[-3000:]
    assert "Timed out" in done.stderr or "Connection closed by peer" in done.stderr, \
        done.stderr[-3000:]
    assert not (root / "off" / "run_fsdp2" / "summary.json").exists()


def test_fsdp2_stop_and_resume_equals_the_uninterrupted_run(root, demo_runs):
    """Checkpoints hold full model and optimizer state; a resume re-shards them exactly."""
    from megatron_packing.config.training import training_config_from_dict
    from megatron_packing.demo.trainer import RunSpec, launch_runs

    runs = demo_runs
    cfg = training_config_from_dict(_document(root, "fsdp2"))
    out = str(root / "resumed")
    launch_runs(cfg, [RunSpec(output_dir=out, stop_after=1, use_wandb=False, quiet=True)])
    assert len(read_jsonl(Path(out) / "metrics.jsonl")) == 1
    launch_runs(cfg, [RunSpec(output_dir=out, resume=True, use_wandb=False, quiet=True)])
    full = read_jsonl(runs["fsdp2"] / "metrics.jsonl")
    resumed = read_jsonl(Path(out) / "metrics.jsonl")
    for key in ("train/loss", "train/grad_norm", "train/lr", "train/actual_batch_size"):
        assert [r[key] for r in resumed] == [r[key] for r in full], key
