"""End-to-end training in real gloo processes: exact kill-and-resume, logged batch sizes.

Two process launches serve every test here: launch 1 runs an uninterrupted run and the first
part of two interrupted runs (dataloader workers 0 and 2), which save and stop; launch 2
(new processes) resumes both and finishes.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from megatron_packing.config import PackingConfig
from megatron_packing.config.training import training_config_from_dict
from megatron_packing.loader.metrics import read_jsonl

REPO = Path(__file__).resolve().parents[2]
DEMO_DATA = REPO / "examples" / "data" / "demo_chat.jsonl"
TOKENIZER = REPO / "examples" / "tokenizer"
STEPS = 9
STOP_AT = 4
EVAL_EVERY = 4
# Every test here reads the launches of the module fixture ``runs`` (two launches of two ranks).
pytestmark = [pytest.mark.slow, pytest.mark.one_stack(
    "the CPU demo trainer's own runs (scripts/demo.sh runs it on the main stack); megatron-core "
    "0.19's DDP, optimizer and dist_checkpointing under the library's glue run on the second "
    "stack in tests/megatron_lm and tests/bridge")]

PACKING = {"global_batch_size": 8, "bin_capacity": 256, "align_packing_bins_to_dp": True,
           "packing_batch_size_allowed_variation": 0.25, "oversize_policy": "truncate",
           "seed": 3}


class _Prefix:
    """The first ``n`` examples of a dataset (what a file of its first n records gives)."""

    def __init__(self, dataset, n: int) -> None:
        self.dataset, self.n = dataset, n
        self.lengths = np.asarray(dataset.lengths[:n])
        self.loss_token_counts = np.asarray(dataset.loss_token_counts[:n])

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.dataset[i]


def _global_plans(dataset, steps: int) -> list:
    from megatron_packing.packed.components import build_packing_sampler

    sampler = build_packing_sampler(dataset, PackingConfig(**PACKING), dp_rank=None, dp_size=2,
                                    seed=PACKING["seed"], total_steps=steps)
    plans = []
    while len(plans) < steps:
        plans += [batch.plan for batch in itertools.islice(iter(sampler), steps - len(plans))]
    return plans


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megatron_packing.data import load_sft_dataset
    from megatron_packing.demo.trainer import RunSpec, launch_runs

    root = tmp_path_factory.mktemp("training")
    lines = DEMO_DATA.read_text().splitlines()[:90]
    probe = load_sft_dataset([str(_write(root / "probe.jsonl", lines))], str(TOKENIZER),
                             cache_dir=str(root / "cache"), show_progress=False)
    # The smallest prefix of the demo data whose schedule has a tail step with placeholder rows.
    for n in range(30, len(lines)):
        ds = _Prefix(probe, n)
        if any(p.placeholder_bins for p in _global_plans(ds, STEPS)):
            break
    else:
        pytest.fail("no prefix of the demo data gives a placeholder row")
    data = _write(root / "data.jsonl", lines[:n])
    valid = _write(root / "valid.jsonl", DEMO_DATA.read_text().splitlines()[200:230])
    cfg = training_config_from_dict({
        "packing": PACKING,
        "data": {"paths": [str(data)], "tokenizer": str(TOKENIZER), "cache_dir": str(root / "cache"),
                 "valid_paths": [str(valid)]},
        "model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2},
        "train": {"steps": STEPS, "lr": 0.01, "warmup_steps": 2, "dp_size": 2,
                  "checkpoint_every": 100, "eval_every": EVAL_EVERY},
        "logging": {"wandb": False, "plot": False},
    })
    dirs = {name: str(root / name) for name in ("full", "w0", "w2")}
    launch_runs(cfg, [RunSpec(dirs["full"], num_workers=0, quiet=True),
                      RunSpec(dirs["w0"], num_workers=0, stop_after=STOP_AT, quiet=True),
                      RunSpec(dirs["w2"], num_workers=2, stop_after=STOP_AT, quiet=True)])
    part1 = {k: read_jsonl(Path(dirs[k]) / "metrics.jsonl") for k in ("w0", "w2")}
    launch_runs(cfg, [RunSpec(dirs["w0"], resume=True, num_workers=0, quiet=True),
                      RunSpec(dirs["w2"], resume=True, num_workers=2, quiet=True)])
    full_ds = load_sft_dataset([str(data)], str(TOKENIZER), cache_dir=str(root / "cache"),
                               show_progress=False)
    return {"dirs": dirs, "part1": part1, "plans": _global_plans(full_ds, STEPS), "cfg": cfg,
            "valid": str(valid)}


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def _metrics(run_dir: str) -> list[dict]:
    return read_jsonl(Path(run_dir) / "metrics.jsonl")


@pytest.mark.parametrize("name", ["w0", "w2"])
def test_kill_and_resume_matches_uninterrupted(runs, name):
    full = _metrics(runs["dirs"]["full"])
    resumed = _metrics(runs["dirs"][name])
    assert len(runs["part1"][name]) == STOP_AT  # the first launch really stopped early
    assert [r["step"] for r in resumed] == list(range(STEPS))
    for a, b in zip(full, resumed, strict=True):
        for key in ("train/actual_batch_size", "train/actual_num_tokens", "train/loss_tokens",
                    "train/bins", "train/loss", "train/lr", "train/grad_norm"):
            assert a[key] == b[key], (a["step"], key)
    summary = json.loads((Path(runs["dirs"][name]) / "summary.json").read_text())
    assert summary["examples"] == sum(r["train/actual_batch_size"] for r in full)


@pytest.mark.parametrize("name", ["full", "w2"])
def test_logged_batch_size_is_the_plans_real_examples(runs, name):
    """num_workers=0 (full) and collation prefetched by 2 workers (w2, across a resume)."""
    logged = _metrics(runs["dirs"][name])
    plans = runs["plans"]
    assert len(logged) == len(plans) == STEPS
    assert any(p.placeholder_bins for p in plans), "the schedule must include a placeholder tail"
    for record, plan in zip(logged, plans, strict=True):
        real = sum(len(b) for b in plan.bins)
        assert record["train/actual_batch_size"] == real == plan.num_examples
        assert record["train/placeholder_bins"] == sum(1 for b in plan.bins if not b)
        assert record["train/bins"] == plan.num_bins
        assert record["train/loss_tokens"] == plan.num_loss_tokens


def test_loss_falls_and_outputs_exist(runs):
    full = _metrics(runs["dirs"]["full"])
    assert full[-1]["train/loss"] < full[0]["train/loss"]
    ckpt = Path(runs["dirs"]["full"]) / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == f"step_{STEPS:06d}"
    saved = ckpt / f"step_{STEPS:06d}"
    assert {p.name for p in saved.iterdir()} == {"rank0.pt", "rank1.pt", "manifest.json",
                                                 "weights"}
    # the model and optimizer: megatron-core's distributed checkpoint, written by both ranks
    # (__<rank>_<thread>.distcp: the writes spread over the data-parallel ranks), every file
    # in the manifest
    shards = sorted(p.name for p in (saved / "weights").glob("*.distcp"))
    assert {name.split("_")[2] for name in shards} == {"0", "1"}
    assert (saved / "weights" / ".metadata").is_file()
    listed = json.loads((saved / "manifest.json").read_text())["files"]
    assert {f"weights/{name}" for name in shards} <= set(listed)


def _valid(run_dir: str) -> list[dict]:
    return read_jsonl(Path(run_dir) / "valid.jsonl")


def test_validation_runs_when_due_and_after_training_and_resumes_exactly(runs):
    full = _valid(runs["dirs"]["full"])
    assert [r["step"] for r in full] == [4, 8, STEPS]  # every eval_every steps, then the last
    assert len({r["valid/loss"] for r in full}) == 3  # the model moved between them
    for name in ("w0", "w2"):  # stopped after step 4 (validated), resumed: the same losses
        assert _valid(runs["dirs"][name]) == full


def test_the_validation_loss_is_the_token_mean_over_every_validation_example(runs, tmp_path):
    """The final validation, recomputed one example per forward from the final checkpoint."""
    from dp_workers import validation_reference

    from megatron_packing.demo.launch import spawn_data_parallel

    out = runs["dirs"]["full"]
    result = tmp_path / "reference.json"
    spawn_data_parallel(validation_reference, 1, runs["cfg"], out, runs["valid"], str(result))
    reference = json.loads(result.read_text())
    assert reference["checkpoint"] == f"step_{STEPS:06d}"
    assert _valid(out)[-1]["valid/loss"] == pytest.approx(reference["loss"], rel=1e-5)


def test_the_replicated_backend_trains_with_megatron_cores_ddp_and_optimizer(runs):
    """megatron_ddp: megatron-core's optimizer made the parameter groups (decay off for biases
    and norm weights, Megatron's rule), and the saved weights are the unwrapped model's, in
    megatron-core's distributed checkpoint."""
    from megatron.core import dist_checkpointing

    from megatron_packing.demo.checkpoint import SHARED, latest_checkpoint, load_checkpoint

    checkpoint = latest_checkpoint(runs["dirs"]["full"])
    assert checkpoint is not None
    common = dist_checkpointing.load_common_state_dict(str(checkpoint / SHARED))
    groups = common["optimizer"]["param_groups"]
    assert sorted(g["wd_mult"] for g in groups) == [0.0, 1.0]
    tensors = dist_checkpointing.load_tensors_metadata(str(checkpoint / SHARED))
    assert "embedding.word_embeddings.weight" in tensors
    assert not any(key.startswith("module.") for key in tensors)
    state = load_checkpoint(checkpoint, 0, 2)
    assert set(state) == {"scheduler", "dataloader", "step"}  # the rank's own part only
    assert state["scheduler"]["num_steps"] == sum(r["train/actual_batch_size"]
                                                  for r in _metrics(runs["dirs"]["full"]))


def test_resume_on_another_number_of_ranks_and_workers_plans_the_rest_there(runs, tmp_path):
    """Stopped at DP 2 with 2 loader workers, resumed at DP 3 with none: the resumed steps are
    what a fresh sampler at DP 3 plans from the saved global part, and the counts continue."""
    import dataclasses

    import torch

    from megatron_packing.data import load_sft_dataset
    from megatron_packing.demo.checkpoint import latest_checkpoint
    from megatron_packing.demo.trainer import RunSpec, launch_runs
    from megatron_packing.packed.components import build_packing_sampler

    cfg = runs["cfg"]
    out = str(tmp_path / "resized")
    launch_runs(cfg, [RunSpec(out, num_workers=2, stop_after=STOP_AT, quiet=True)])
    saved = latest_checkpoint(out)
    assert saved is not None
    part = torch.load(saved / "rank0.pt", weights_only=False)["dataloader"]["global"]["loader"]
    assert (part["dp_size"], part["num_workers"]) == (2, 2)
    three = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, dp_size=3))
    launch_runs(three, [RunSpec(out, resume=True, num_workers=0, quiet=True)])
    logged = _metrics(out)
    assert [r["step"] for r in logged] == list(range(STEPS))
    dataset = load_sft_dataset(cfg.data.paths, cfg.data.tokenizer, cache_dir=cfg.data.cache_dir,
                               show_progress=False)
    fresh = build_packing_sampler(dataset, cfg.packing, dp_rank=None, dp_size=3,
                                  seed=PACKING["seed"], total_steps=STEPS)
    fresh.load_state_dict(part["sampler"])
    plans = [batch.plan for batch in fresh]
    while len(plans) < STEPS - STOP_AT:
        plans += [batch.plan for batch in fresh]
    for record, plan in zip(logged[STOP_AT:], plans, strict=False):
        assert record["train/actual_batch_size"] == plan.num_examples
        assert record["train/bins"] == plan.num_bins and plan.num_bins % 3 == 0
        assert record["train/loss_tokens"] == plan.num_loss_tokens
    summary = json.loads((Path(out) / "summary.json").read_text())
    assert summary["examples"] == sum(r["train/actual_batch_size"] for r in logged)
