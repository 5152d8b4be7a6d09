"""A write the OS refuses ends the run with one message: the path, the OS error and the last
complete checkpoint, which stays intact; what third-party writers printed is in a log file the
message names, not on the screen.

The launches write onto file systems that really refuse: a read-only mount (mode 0555 does not
stop root), a directory under /sys, a small tmpfs that fills, and ``ulimit -f`` (RLIMIT_FSIZE,
set in the launched process). The in-process tests stand in for a writer at the OS boundary.
"""

from __future__ import annotations

import errno
import os
import re
import resource
import subprocess
import uuid
from pathlib import Path

import pytest

from megatron_packing.demo import checkpoint as ckpt
from megatron_packing.demo import write_faults

from .process_checks import can_mount, file_size_limit, fill, read_only_dir, tmpfs
from .run_faults_helpers import cli_env, tiny_config, train_command, write_config

THIRD_PARTY = ("Traceback", "CheckpointException", "Local process", "enforce fail",
               "torch.distributed", "megatron/core")
needs_mount = pytest.mark.skipif(not can_mount(), reason="mounting a small tmpfs needs root")


def _train(tmp: Path, out: Path, *, steps: int = 4, every: int = 2, preexec=None,
           cache: Path | None = None) -> subprocess.CompletedProcess:
    doc = tiny_config(tmp, steps=steps, train__checkpoint_every=every)
    if cache is not None:
        doc["data"]["cache_dir"] = str(cache)
    return subprocess.run(train_command(write_config(tmp / "c.yaml", doc), out, "--no-wandb"),
                          capture_output=True, text=True, timeout=300, env=cli_env(), cwd=tmp,
                          preexec_fn=preexec)


def _one_message(result: subprocess.CompletedProcess) -> str:
    """The run's one error line (exit 1: a fault), with nothing of third parties beside it."""
    assert result.returncode == 1, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr[-3000:]
    for raw in THIRD_PARTY:
        assert raw not in result.stderr + result.stdout, result.stderr[-3000:]
    assert lines[0].startswith("megatron-packing train: error: ")
    return lines[0]


def _logs(message: str) -> list[Path]:
    found = re.search(r"the writers' messages and tracebacks are in (.+)$", message)
    assert found, message
    return [Path(p) for p in found.group(1).split(", ")]


# ---- launches -------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_read_only_output_directory_is_one_message(tmp_path):
    with read_only_dir(tmp_path / "out") as out:
        message = _one_message(_train(tmp_path, out))
    expected = "Read-only file system" if can_mount() else "Permission denied"
    assert f"cannot write {out.resolve()}/.run.lock: [Errno " in message
    assert expected in message and f"{out.resolve()} holds no complete checkpoint yet" in message


@pytest.mark.slow
def test_an_output_directory_that_cannot_be_created_is_one_message(tmp_path):
    out = Path("/sys") / f"megatron-packing-{uuid.uuid4().hex[:8]}"
    message = _one_message(_train(tmp_path, out))
    assert re.search(rf"cannot write {out}: \[Errno (1|13|30)\] ", message), message
    assert not out.exists()


@pytest.mark.slow
@needs_mount
def test_a_disk_that_fills_at_a_checkpoint_keeps_the_last_one(tmp_path):
    # A checkpoint of this run takes about 2.3 MB: the first fits, the second does not.
    with tmpfs(tmp_path / "out", size="3500k") as out:
        message = _one_message(_train(tmp_path, out, steps=6))
        root = out / "checkpoints"
        assert re.search(rf"checkpoint of step 4 failed: cannot write {root}/step_000004\.partial"
                         r"\S*: \[Errno 28\] No space left on device; nothing was published and "
                         rf"the last complete checkpoint {root}/step_000002 is intact", message)
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002"]
        assert ckpt.find_resume_checkpoint(out, world_size=2)[0] == root / "step_000002"
        kept = "".join(p.read_text() for p in _logs(message))
        assert "Traceback" in kept and "CheckpointException" in kept


@pytest.mark.slow
def test_the_file_size_limit_at_a_checkpoint_is_one_message(tmp_path):
    from megatron_packing.config.data_loading import load_data_split
    from megatron_packing.config.training import training_config_from_dict

    cfg = training_config_from_dict(tiny_config(tmp_path))
    load_data_split(cfg.data, cfg.data.paths, resolve=cfg.resolve, build_sharers=1)  # unlimited
    out = tmp_path / "out"
    message = _one_message(_train(tmp_path, out, preexec=file_size_limit(300_000)))
    root = out / "checkpoints"
    assert re.search(rf"checkpoint of step 2 failed: cannot write {root}/step_000002\.partial/"
                     r"weights/\S+: \[Errno 27\] File too large; nothing was published and "
                     rf"{out} holds no complete checkpoint yet", message), message
    assert _logs(message) == [out / "logs" / "write_faults.rank0.log",
                              out / "logs" / "write_faults.rank1.log"]
    assert "Traceback" in _logs(message)[0].read_text()
    assert sorted(p.name for p in root.iterdir()) == []


@pytest.mark.slow
@needs_mount
def test_a_disk_full_before_the_first_step_names_the_metrics_file(tmp_path):
    with tmpfs(tmp_path / "out", size="256k") as out:
        (out / ".run.lock").write_text("0" * 16)  # room for the lock's pid: the run starts
        fill(out)
        message = _one_message(_train(tmp_path, out))
    assert message.endswith(f"cannot write {out}/metrics.jsonl: [Errno 28] No space left on "
                            f"device; {out} holds no complete checkpoint yet"), message


# ---- in-process: the writer's failure at the OS boundary ------------------------------------

def _state(value: float) -> dict:
    import torch

    return {"model": {"w": torch.full((64,), value)}}


def test_an_os_error_inside_a_torch_checkpoint_exception_is_found():
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/x/__0_0.distcp")
    try:
        raise RuntimeError("Worker failure") from full
    except RuntimeError as worker:
        wrapped = CheckpointException("write", {0: _wrap_exception(worker)})
    assert write_faults.find_write_error(wrapped) is full
    assert write_faults.find_write_error(CheckpointException("write", {})) is None


def test_a_writer_that_loses_the_errno_is_named_by_a_probe(tmp_path):
    """torch's C++ writer says ``unexpected pos`` where the OS said EFBIG: the probe write into
    the writer's directory finds the file that reached the limit and the OS error."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)

    def writer(directory: Path) -> None:
        with open(directory / "__0_0.distcp", "wb", buffering=0) as f:
            try:
                f.write(b"\0" * 200_000)
                f.write(b"\0")
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos "
                                   "704 vs 598") from None

    ckpt.save_checkpoint(tmp_path, 2, 0, _state(2), keep=3, write_shared=lambda d: None)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))
    try:
        with pytest.raises(write_faults.WriteFault) as info:
            ckpt.save_checkpoint(tmp_path, 4, 0, _state(4), keep=3, write_shared=writer)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    root = ckpt.checkpoint_root(tmp_path)
    assert str(info.value).startswith(
        f"checkpoint of step 4 failed: cannot write {root}/step_000004.partial/weights/"
        f"__0_0.distcp: [Errno 27] File too large; nothing was published and the last complete "
        f"checkpoint {root / 'step_000002'} is intact")
    log = tmp_path / "logs" / "write_faults.rank0.log"
    assert str(info.value).endswith(f"the writers' messages and tracebacks are in {log}")
    assert "unexpected pos 704 vs 598" in log.read_text()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002"]
