"""Helpers of the training-run fault tests: tiny configs, CLI subprocesses, process trees."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DEMO_DATA = REPO / "examples" / "data" / "demo_chat.jsonl"
TOKENIZER = REPO / "examples" / "tokenizer"


def demo_subset(tmp: Path, n: int = 160) -> Path:
    """The first ``n`` records of the shipped demo data (quick to tokenize)."""
    path = tmp / f"demo_{n}.jsonl"
    if not path.exists():
        path.write_text("".join(DEMO_DATA.read_text().splitlines(keepends=True)[:n]))
    return path


def tiny_config(tmp: Path, *, data: Path | None = None, steps: int = 3, **overrides) -> dict:
    """A training document for a 1-layer model on part of the demo data (seconds per step)."""
    data = data or demo_subset(tmp)
    doc = {
        "packing": {"global_batch_size": 8, "bin_capacity": 256, "align_packing_bins_to_dp": True,
                    "packing_batch_size_allowed_variation": 0.25, "oversize_policy": "truncate",
                    "seed": 3},
        "data": {"paths": [str(data)], "tokenizer": str(TOKENIZER),
                 "cache_dir": str(tmp / "cache")},
        "model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2},
        "train": {"steps": steps, "lr": 0.01, "warmup_steps": 1, "dp_size": 2,
                  "checkpoint_every": 100, "log_every": 1},
        "logging": {"wandb": False, "plot": False},
    }
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        doc[section][key] = value
    return doc


def write_config(path: Path, doc: dict) -> Path:
    path.write_text(yaml.safe_dump(doc))
    return path


def cli_env(extra_path: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, str(REPO),
                                                    env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["WANDB_MODE"] = "offline"
    return env


def train_command(config: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "megatron_packing.cli", "train", "--config", str(config),
            "--output-dir", str(out), *extra]


def run_cli(args: list[str], *, timeout: float = 120, extra_path: str | None = None):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                          env=cli_env(extra_path), cwd=REPO)


def start_cli(args: list[str], log: Path) -> subprocess.Popen:
    """Start a CLI run with stdout and stderr going to ``log``."""
    handle = log.open("w")
    return subprocess.Popen(args, stdout=handle, stderr=subprocess.STDOUT, env=cli_env(),
                            cwd=REPO, start_new_session=True)


def wait_for_text(log: Path, text: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in log.read_text():
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended (rc {proc.returncode}) before {text!r}:\n"
                                 f"{log.read_text()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"no {text!r} within {timeout} s:\n{log.read_text()[-3000:]}")


def children_of(pid: int) -> list[int]:
    """Direct child pids of ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout: float = 15) -> list[int]:
    """The pids still alive after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]
