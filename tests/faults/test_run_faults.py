"""Training-run faults: bad configs, empty data, kills and signals, torchrun, W&B resume,
checkpoint damage and disk full. Every case asserts the message a user sees (kills of the
launcher, a rank or the group: test_process_lifetime.py; refused writes: test_write_faults.py).

Process tests start the real ``megatron-packing train`` (2 gloo ranks, a 1-layer model on the
shipped demo data) and kill the real processes.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from megatron_packing.config import ConfigError
from megatron_packing.config.training import load_training_config
from megatron_packing.demo import checkpoint as ckpt
from megatron_packing.demo.write_faults import WriteFault
from megatron_packing.loader.metrics import read_jsonl

from .run_faults_helpers import (
    children_of,
    run_cli,
    start_cli,
    tiny_config,
    train_command,
    wait_for_text,
    wait_gone,
    write_config,
)

TORCHRUN = Path(sys.executable).with_name("torchrun")


# ---- configuration: refused at load time, before any rank starts ----------------------------

@pytest.mark.parametrize(("key", "value", "message"), [
    ("train__checkpoint_every", 0, "train.checkpoint_every must be an integer >= 1, got 0"),
    ("train__log_every", 0, "train.log_every must be an integer >= 1, got 0"),
    ("train__lr", 0, "train.lr must be a number > 0, got 0"),
    ("train__checkpoint_keep", 0, "train.checkpoint_keep must be an integer >= 1, got 0"),
    ("train__min_lr", 1.0, "train.min_lr must be <= train.lr (0.01), got 1.0"),
    ("train__seed", 7, "unknown train key 'seed' (valid keys: backend,"),
    ("packing__oversize_policy", "own_bin", "'own_bin' is not supported by the demo trainer"),
    ("train__backend", "deepspeed",
     "train.backend must be one of megatron_ddp, fsdp2; got 'deepspeed'"),
    ("model__num_attention_heads", 3, "model.num_attention_heads must be a divisor of"),
    ("data__paths", ["/nonexistent/x.jsonl"], "data.paths[0] '/nonexistent/x.jsonl' does not exist"),
    ("logging__wandb_mode", "cloud", "logging.wandb_mode must be one of offline, online, disabled"),
])
def test_bad_training_value_is_refused_by_name(tmp_path, key, value, message):
    path = write_config(tmp_path / "bad.yaml", tiny_config(tmp_path, **{key: value}))
    with pytest.raises(ConfigError) as info:
        load_training_config(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("train:\n  steps: 3\n  lr: [0.1\nmodel: {}\n")
    with pytest.raises(ConfigError, match=rf"{path}:4:\d+: YAML syntax error"):
        load_training_config(path)


@pytest.mark.slow
def test_cli_refuses_bad_config_before_starting_ranks(tmp_path):
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path, train__checkpoint_every=0))
    out = tmp_path / "out"
    result = run_cli(train_command(config, out, "--no-wandb"), timeout=60)
    assert result.returncode == 2, result.stderr
    assert "error:" in result.stderr and "train.checkpoint_every must be an integer >= 1" in result.stderr
    assert "Traceback" not in result.stderr and "[train]" not in result.stdout
    assert not out.exists()  # nothing started: not even the output directory


@pytest.mark.slow
@pytest.mark.parametrize("case", ["empty file", "every record bad"])
def test_cli_refuses_a_dataset_with_nothing_to_train(tmp_path, case):
    data = tmp_path / "data.jsonl"
    data.write_text("" if case == "empty file" else '{"messages": []}\n{"messages": 5}\n')
    doc = tiny_config(tmp_path, data=data, data__on_bad_record="skip")
    result = run_cli(train_command(write_config(tmp_path / "c.yaml", doc), tmp_path / "out",
                                   "--no-wandb"), timeout=90)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"no examples to train on in {data}" in result.stderr
    expected = "the files hold no records" if case == "empty file" else \
        "every record was skipped as bad (2 records"
    assert expected in result.stderr
    assert "StopIteration" not in result.stderr and "Traceback" not in result.stderr


# ---- checkpoints: atomic, keep-last-N, damaged refused, disk full --------------------------

def _state(value: float) -> dict:
    import torch

    return {"model": {"w": torch.full((64,), value)}}


def test_checkpoints_are_published_complete_and_only_the_newest_n_kept(tmp_path):
    for step in (2, 4, 6, 8):
        ckpt.save_checkpoint(tmp_path, step, 0, _state(step), keep=2)
    root = ckpt.checkpoint_root(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000006", "step_000008"]
    assert sorted(p.name for p in (root / "step_000008").iterdir()) == ["manifest.json", "rank0.pt"]
    found, notes = ckpt.find_resume_checkpoint(tmp_path, world_size=1)
    assert found == root / "step_000008" and notes == []
    assert float(ckpt.load_checkpoint(found, 0, 1)["model"]["w"][0]) == 8.0


def test_half_written_save_is_ignored_and_damaged_checkpoint_refused(tmp_path):
    ckpt.save_checkpoint(tmp_path, 2, 0, _state(2), keep=3)
    ckpt.save_checkpoint(tmp_path, 4, 0, _state(4), keep=3)
    root = ckpt.checkpoint_root(tmp_path)
    # A save killed midway: its .partial directory is skipped, and said so.
    (root / "step_000006.partial").mkdir()
    (root / "step_000006.partial" / "rank0.pt.tmp").write_bytes(b"half")
    found, notes = ckpt.find_resume_checkpoint(tmp_path, world_size=1)
    assert found == root / "step_000004"
    assert notes == [f"ignoring {root / 'step_000006.partial'} (a save that never completed)"]
    # The published checkpoint truncated afterwards: refused by name, with the way out.
    rank_file = root / "step_000004" / "rank0.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:1000])
    with pytest.raises(ckpt.CheckpointError, match=r"step_000004 is damaged: rank0.pt has 1000 "
                       r"bytes.*to resume from step_000002"):
        ckpt.find_resume_checkpoint(tmp_path, world_size=1)
    (root / "step_000004" / "manifest.json").unlink()
    with pytest.raises(ckpt.CheckpointError, match="step_000004 is half-written: manifest.json"):
        ckpt.find_resume_checkpoint(tmp_path, world_size=1)
    # Another size needs the loader state's global part, which these rank files lack.
    with pytest.raises(ckpt.CheckpointError, match=r"saved by 1 ranks by an earlier release.*"
                       "no global part to plan from on 2 ranks: resume with train.dp_size: 1"):
        ckpt.verify_checkpoint(root / "step_000002", world_size=2)


def test_disk_full_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    ckpt.save_checkpoint(tmp_path, 2, 0, _state(2), keep=3)
    before = (ckpt.checkpoint_root(tmp_path) / "step_000002" / "rank0.pt").read_bytes()
    real_write = ckpt._write_file

    def disk_full(path, data):  # writes half, then the disk is full
        real_write(path, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(ckpt, "_write_file", disk_full)
    with pytest.raises(WriteFault) as info:
        ckpt.save_checkpoint(tmp_path, 4, 0, _state(4), keep=3)
    root = ckpt.checkpoint_root(tmp_path)
    assert str(info.value) == (
        f"checkpoint of step 4 failed: cannot write {root}/step_000004.partial/rank0.pt: "
        "[Errno 28] No space left on device; nothing was published and the last complete "
        f"checkpoint {root / 'step_000002'} is intact (--resume continues from it once the "
        "fault is fixed)")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002"]
    assert (root / "step_000002" / "rank0.pt").read_bytes() == before
    assert ckpt.find_resume_checkpoint(tmp_path, world_size=1)[0] == root / "step_000002"


def _write_weights(value: int):
    """A stand-in for the ranks' collective writer: two files under the shared directory."""
    def write(directory):
        (directory / "__0_0.distcp").write_bytes(bytes([value]) * 4096)
        (directory / ".metadata").write_bytes(b"meta")
    return write


def test_the_shared_writers_files_are_published_in_the_manifest_and_checked(tmp_path):
    ckpt.save_checkpoint(tmp_path, 2, 0, _state(2), keep=3, write_shared=_write_weights(2))
    ckpt.save_checkpoint(tmp_path, 4, 0, _state(4), keep=3, write_shared=_write_weights(4))
    root = ckpt.checkpoint_root(tmp_path)
    saved = root / "step_000004"
    assert sorted(p.name for p in saved.iterdir()) == ["manifest.json", "rank0.pt", ckpt.SHARED]
    listed = json.loads((saved / ckpt.MANIFEST).read_text())["files"]
    assert sorted(listed) == ["rank0.pt", "weights/.metadata", "weights/__0_0.distcp"]
    assert ckpt.find_resume_checkpoint(tmp_path, world_size=1)[0] == saved
    shard = saved / ckpt.SHARED / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # truncated after publishing
    with pytest.raises(ckpt.CheckpointError, match=r"step_000004 is damaged: weights/__0_0.distcp "
                       r"has 100 bytes.*to resume from step_000002"):
        ckpt.find_resume_checkpoint(tmp_path, world_size=1)


def test_disk_full_in_the_shared_writer_keeps_the_previous_checkpoint(tmp_path):
    ckpt.save_checkpoint(tmp_path, 2, 0, _state(2), keep=3, write_shared=_write_weights(2))

    def disk_full(directory):
        (directory / "__0_0.distcp").write_bytes(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory / "__0_0.distcp"))

    with pytest.raises(WriteFault) as info:
        ckpt.save_checkpoint(tmp_path, 4, 0, _state(4), keep=3, write_shared=disk_full)
    root = ckpt.checkpoint_root(tmp_path)
    assert (f"cannot write {root}/step_000004.partial/weights/__0_0.distcp: [Errno 28] No space "
            "left on device") in str(info.value)
    assert f"the last complete checkpoint {root / 'step_000002'} is intact" in str(info.value)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002"]
    assert ckpt.find_resume_checkpoint(tmp_path, world_size=1)[0] == root / "step_000002"


def test_a_writer_error_that_is_not_an_os_error_is_named_and_nothing_is_published(tmp_path):
    def broken(directory):
        raise RuntimeError("tensor storage could not be read\nsecond line")

    with pytest.raises(ckpt.CheckpointError, match=r"checkpoint of step 2 failed: could not "
                       r"write .*weights: RuntimeError: tensor storage could not be read; "
                       rf"nothing was published and {tmp_path} holds no complete checkpoint yet; "
                       r"the writers' messages and tracebacks are in .*write_faults.rank0.log"):
        ckpt.save_checkpoint(tmp_path, 2, 0, _state(2), keep=3, write_shared=broken)
    assert sorted(p.name for p in ckpt.checkpoint_root(tmp_path).iterdir()) == []


# ---- processes: kills, signals, the run lock ------------------------------------------------

def _long_run(tmp_path: Path) -> tuple[Path, Path]:
    config = write_config(tmp_path / "c.yaml",
                          tiny_config(tmp_path, steps=400, train__checkpoint_every=1000))
    return config, tmp_path / "out"


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_the_run_cleanly_and_a_second_run_is_refused_meanwhile(tmp_path, signum):
    config, out = _long_run(tmp_path)
    log = tmp_path / "run.log"
    launcher = start_cli(train_command(config, out, "--no-wandb"), log)
    try:
        wait_for_text(log, "[train] step    2", launcher)
        second = run_cli(train_command(config, out, "--no-wandb", "--resume"), timeout=90)
        assert second.returncode == 2
        assert (f"output directory {out.resolve()} is in use by another training run "
                f"(pid {launcher.pid}") in second.stderr
        ranks = children_of(launcher.pid)
        sent = time.monotonic()
        os.kill(launcher.pid, signum)
        rc = launcher.wait(timeout=60)
        took = time.monotonic() - sent
        text = log.read_text()
        assert rc == 128 + signum, text[-2000:]
        assert took < 30, took
        assert f"stopped by {signal.Signals(signum).name}" in text
        assert wait_gone(ranks, timeout=10) == []
        # Every rank stopped at the same step and saved it: the final checkpoint is that step.
        steps_done = len(read_jsonl(out / "metrics.jsonl"))
        latest = (out / "checkpoints" / "latest").read_text().strip()
        assert latest == f"step_{steps_done:06d}" and steps_done >= 2
        assert f"stopped after step {steps_done} of 400" in text
    finally:
        launcher.kill()


# ---- torchrun, the one seed, missing matplotlib ---------------------------------------------

def _token_series(out: Path) -> list[int]:
    return [r["train/actual_num_tokens"] for r in read_jsonl(out / "metrics.jsonl")]


@pytest.fixture(scope="module")
def seed3_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("seed3")
    config = write_config(tmp / "c.yaml", tiny_config(tmp))
    result = run_cli(train_command(config, tmp / "out", "--no-wandb"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "out"


@pytest.mark.slow
def test_torchrun_runs_each_process_as_one_rank(tmp_path, seed3_run):
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path))
    out = tmp_path / "out"
    from megatron_packing.demo.launch import free_port

    command = [str(TORCHRUN), "--nproc-per-node", "2", "--master-port", str(free_port()),
               "-m", "megatron_packing.cli", "train", "--config", str(config),
               "--output-dir", str(out), "--no-wandb"]
    result = run_cli(command, timeout=300)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    assert result.stdout.count("== summary ==") == 1  # rank 0 reports, rank 1 does not
    # Same config as the spawned run: the same steps, bit for bit.
    spawned, launched = read_jsonl(seed3_run / "metrics.jsonl"), read_jsonl(out / "metrics.jsonl")
    assert [r["train/loss"] for r in launched] == [r["train/loss"] for r in spawned]
    assert _token_series(out) == _token_series(seed3_run)


@pytest.mark.slow
def test_packing_seed_decides_the_order_and_missing_matplotlib_only_skips_the_plot(
        tmp_path, seed3_run):
    shim = tmp_path / "no_matplotlib"
    (shim / "matplotlib").mkdir(parents=True)
    (shim / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    doc = tiny_config(tmp_path, logging__plot=True)
    doc["packing"]["seed"] = 4
    out = tmp_path / "out"
    result = run_cli(train_command(write_config(tmp_path / "c.yaml", doc), out, "--no-wandb"),
                     extra_path=str(shim), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warning: matplotlib is not installed, skipping metrics.png" in result.stderr
    assert not (out / "metrics.png").exists() and (out / "summary.json").exists()
    assert _token_series(out) != _token_series(seed3_run)
    shown = run_cli([sys.executable, "-m", "megatron_packing.cli", "inspect", "--config",
                     str(tmp_path / "c.yaml")], timeout=60)
    assert "  seed: 4   (the example order's seed: the one `train` uses)" in shown.stdout


# ---- W&B: --resume continues the same run -------------------

@pytest.mark.slow
def test_wandb_resume_continues_the_same_run(tmp_path, monkeypatch):
    from megatron_packing.config.training import training_config_from_dict
    from megatron_packing.demo.trainer import RunSpec, launch_runs

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    doc = tiny_config(tmp_path, steps=4, train__checkpoint_every=2, logging__wandb=True)
    cfg = training_config_from_dict(doc)
    out = tmp_path / "out"
    launch_runs(cfg, [RunSpec(str(out), stop_after=3, quiet=True)])
    # As if killed after logging step index 2 but before its checkpoint was saved.
    root = out / "checkpoints"
    shutil.rmtree(root / "step_000003")
    (root / "latest").write_text("step_000002\n")
    launch_runs(cfg, [RunSpec(str(out), resume=True, quiet=True)])
    run_id = (out / "wandb_run_id").read_text().strip()
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(p.name.endswith(f"-{run_id}") for p in runs), runs
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1, 2, 3]
