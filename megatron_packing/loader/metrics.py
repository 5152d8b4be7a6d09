"""Per-step training metrics and where they go (W&B, a JSONL file, memory for tests).

`step_metrics` turns a step's `StepMetadata` (global facts, identical on every rank) plus the
step's loss and learning rate into the logged names. ``train/actual_batch_size`` is the number
of real examples in the global batch: placeholder rows are never counted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from megatron_packing.common.plan_types import StepMetadata

METRIC_NAMES = (
    "train/actual_batch_size",
    "train/actual_num_tokens",
    "train/loss_tokens",
    "train/bins",
    "train/padding_bins",
    "train/token_fill",
    "train/dp_imbalance",
    "data/plan_ms",
    "train/placeholder_bins",
    "train/micro_batches_per_rank",
    "train/aligned",
    "train/evened",
)


def step_metrics(meta: StepMetadata, *, loss: float | None = None,
                 lr: float | None = None) -> dict[str, float]:
    """The metrics of one step, keyed by their logged names."""
    metrics: dict[str, float] = {
        "train/actual_batch_size": int(meta.num_examples),
        "train/actual_num_tokens": int(meta.num_tokens),
        "train/bins": int(meta.num_bins),
        "train/padding_bins": int(meta.num_padding_bins),
        "train/token_fill": float(meta.token_fill),
        "train/dp_imbalance": float(meta.dp_imbalance),
        "data/plan_ms": float(meta.plan_ms),
        "train/placeholder_bins": int(meta.num_placeholder_bins),
        "train/micro_batches_per_rank": int(meta.micro_batches_per_rank),
        "train/aligned": int(bool(meta.aligned)),
        "train/evened": int(bool(meta.evened)),
    }
    if loss is not None:
        metrics["train/loss"] = float(loss)
    if lr is not None:
        metrics["train/lr"] = float(lr)
    if meta.num_loss_tokens is not None:  # unknown counts are left out, never logged as a number
        metrics["train/loss_tokens"] = int(meta.num_loss_tokens)
    # Padded mode: the token budget in force (absent with a fixed micro_batch_size) and the
    # step's padded tokens.
    budget = meta.extra.get("max_tokens_per_microbatch")
    if budget:
        metrics["train/max_tokens_per_microbatch"] = int(budget)
    if "padded_tokens" in meta.extra:
        metrics["train/padded_tokens"] = int(meta.extra["padded_tokens"])
    return metrics


@runtime_checkable
class MetricsLogger(Protocol):
    """Where per-step metrics go."""

    def log(self, metrics: dict[str, Any], step: int) -> None: ...

    def finish(self) -> None: ...


class InMemoryLogger:
    """Keeps every logged record; for tests and for summaries."""

    def __init__(self) -> None:
        self.records: list[tuple[int, dict[str, Any]]] = []
        self.finished = False

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.records.append((step, dict(metrics)))

    def finish(self) -> None:
        self.finished = True

    def series(self, name: str) -> list[Any]:
        return [m[name] for _, m in self.records if name in m]


class JsonlLogger:
    """One JSON object per step (``{"step": ..., <metrics>}``), flushed at once."""

    def __init__(self, path: str | Path, *, append: bool = True) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a" if append else "w")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()

    def finish(self) -> None:
        self._file.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records written by `JsonlLogger`, in order."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_jsonl(path: str | Path, *, keep_steps_below: int) -> int:
    """Drop records of steps >= ``keep_steps_below`` (steps redone after a resume).

    Returns the highest step the file held before (-1 when none): steps already logged.
    """
    path = Path(path)
    before = read_jsonl(path)
    records = [r for r in before if r["step"] < keep_steps_below]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return max((r["step"] for r in before), default=-1)


WANDB_RUN_ID_FILE = "wandb_run_id"


def wandb_run_id(output_dir: str | Path, *, resume: bool) -> str:
    """The W&B run id of ``output_dir``: reused on resume, a new one (stored) otherwise.

    The id lives in ``<output_dir>/wandb_run_id`` so that ``--resume`` continues the same run.
    """
    import secrets

    path = Path(output_dir) / WANDB_RUN_ID_FILE
    if resume and path.exists():
        return path.read_text().strip()
    run_id = secrets.token_hex(4)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n")
    return run_id


class WandbLogger:
    """Thin adapter over a W&B run. Offline unless ``mode`` or ``WANDB_MODE`` says otherwise.

    ``run_id`` resumes that run (``resume="allow"``); steps up to ``logged_through`` were
    already logged to it by an earlier launch and are not sent again.
    """

    def __init__(self, *, project: str, run_name: str | None = None, directory: str | Path,
                 config: dict[str, Any] | None = None, mode: str | None = None,
                 run_id: str | None = None, logged_through: int = -1) -> None:
        import wandb

        resolved = os.environ.get("WANDB_MODE") or mode or "offline"
        Path(directory).mkdir(parents=True, exist_ok=True)
        # wandb's annotation lists four modes, but it also accepts (and itself checks) the
        # older names a WANDB_MODE may hold, such as "dryrun": pass the string through.
        self.run = wandb.init(project=project, name=run_name, dir=str(directory),
                              config=config or {},
                              mode=resolved,  # type: ignore[arg-type]
                              reinit="finish_previous",
                              id=run_id, resume="allow" if run_id else None)
        self.mode = resolved
        self.logged_through = logged_through

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if step > self.logged_through:
            self.run.log(dict(metrics), step=step)

    def finish(self) -> None:
        self.run.finish()


class MultiLogger:
    """Sends every record to several loggers."""

    def __init__(self, loggers: list[MetricsLogger]) -> None:
        self.loggers = list(loggers)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for logger in self.loggers:
            logger.log(metrics, step)

    def finish(self) -> None:
        for logger in self.loggers:
            logger.finish()
