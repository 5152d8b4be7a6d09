"""Per-step time of the packing entry point's loop against Megatron-LM's own ``pretrain()``.

Three runs of the same tiny GPT (tests/megatron_lm/megatron_lm_runs.py's MODEL_ARGS) under
torchrun, 2 data-parallel gloo ranks on CPU, with the test CPU shims applied, interleaved
round by round (after, Megatron, before, after, Megatron, before, ...):

* **Megatron pretrain()**: ``megatron.training.training.pretrain`` with pretrain_gpt.py's
  ``forward_step`` / ``loss_func`` and ``--dataloader-type external``. Its rows are the demo chats'
  tokens concatenated and cut into ``--seq-length`` windows (as Megatron's GPTDataset makes
  them, with the SFT loss mask and a full causal mask), micro-batch 1, a fixed number of rows
  per rank per step: the median row count of this session's first packing run.
* **packing loop after**: ``python -m megatron_packing.megatron_lm`` from this working tree.
* **packing loop before**: the same entry point at an older commit (default 30ae8f8, its
  hand-written loop), from a temporary git worktree.

Every run is timed the same way, from inside rank 0: megatron-core's no-pipelining schedule
and the optimizer's ``step`` are wrapped, and a step's time is the wall time between the starts
of two consecutive schedules (data, schedule, optimizer, logging and whatever else the loop
does). "loop + data" is that minus the schedule and the optimizer step.

    python benchmarks/bench_megatron_lm_vs_pretrain.py [--iters 35] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKER_ENV = "BENCH_VS_PRETRAIN_WORKER"  # set for the torchrun ranks: "pretrain" or "entry"


# ---------------------------------------------------------------- inside a torchrun rank

def _install_step_timers(records: dict[str, list[list[float]]], *, pretrain: bool) -> None:
    """Wrap the schedule (and its per-micro-batch forward and backward) and the optimizer's
    step; ``records`` gets (start, ms[, forward ms, backward ms]) per call."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.training import training

    from megatron_packing.megatron.cpu_workarounds import megatron_optimizer_compat

    schedule = schedules.forward_backward_no_pipelining
    spent = {"forward_step": 0.0, "backward_step": 0.0}  # this schedule's micro-batches, ms

    def timed_part(name: str) -> Any:
        part = getattr(schedules, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            out = part(*args, **kwargs)
            spent[name] += (time.perf_counter() - started) * 1000
            return out

        return timed

    for name in spent:
        setattr(schedules, name, timed_part(name))

    def timed_schedule(*args: Any, **kwargs: Any) -> Any:
        spent.update(forward_step=0.0, backward_step=0.0)
        started = time.perf_counter()
        out = schedule(*args, **kwargs)
        if not kwargs.get("forward_only", False):
            records["schedule"].append([started, (time.perf_counter() - started) * 1000,
                                        spent["forward_step"], spent["backward_step"]])
        return out

    schedules.forward_backward_no_pipelining = timed_schedule
    setup = training.setup_model_and_optimizer

    def timed_setup(*args: Any, **kwargs: Any) -> Any:
        if pretrain:  # the entry point builds its optimizer inside the same CPU compat mode
            with megatron_optimizer_compat():
                model, optimizer, scheduler = setup(*args, **kwargs)
        else:
            model, optimizer, scheduler = setup(*args, **kwargs)
        step = optimizer.step

        def timed_step(*a: Any, **k: Any) -> Any:
            started = time.perf_counter()
            if pretrain:  # as the entry point steps it on CPU
                with megatron_optimizer_compat():
                    out = step(*a, **k)
            else:
                out = step(*a, **k)
            records["optimizer"].append([started, (time.perf_counter() - started) * 1000])
            return out

        optimizer.step = timed_step
        return model, optimizer, scheduler

    training.setup_model_and_optimizer = timed_setup


class _Rows:
    """pretrain()'s external train iterable: this rank's share of fixed windows, cycled."""

    def __init__(self, path: str, rank: int, dp: int) -> None:
        import torch

        windows = torch.load(path)
        self.tokens, self.loss_mask = windows["tokens"], windows["loss_mask"]
        self.index, self.dp = rank, dp
        seq = self.tokens.shape[1] - 1
        self.positions = torch.arange(seq)[None]
        self.causal = torch.tril(torch.ones(1, 1, seq, seq)) < 0.5  # True: masked out

    def __iter__(self) -> _Rows:
        return self

    def __next__(self) -> dict[str, Any]:
        window = self.tokens[self.index % len(self.tokens)]
        mask = self.loss_mask[self.index % len(self.tokens)]
        self.index += self.dp
        return {"tokens": window[None, :-1], "labels": window[None, 1:],
                "loss_mask": mask[None, 1:].float(), "position_ids": self.positions,
                "attention_mask": self.causal}


def _worker() -> int:
    kind = os.environ[WORKER_ENV]
    sys.path.insert(0, os.environ["BENCH_SHIMS_DIR"])
    import cpu_shims  # the CPU shims of the tree being measured

    cpu_shims.apply()
    import torch

    import megatron_packing

    expected = Path(os.environ["BENCH_PROJECT"]).resolve()
    if Path(megatron_packing.__file__).resolve().parents[1] != expected:
        raise SystemExit(f"imported {megatron_packing.__file__}, expected the tree {expected}")
    records: dict[str, list[list[float]]] = {"schedule": [], "optimizer": []}
    _install_step_timers(records, pretrain=kind == "pretrain")
    rank = int(os.environ["RANK"])
    out = Path(os.environ["BENCH_TIMES_DIR"]) / f"times_rank{rank}.json"
    atexit.register(lambda: out.write_text(json.dumps(records)))
    if kind == "entry":
        from megatron_packing.megatron_lm.entry import main

        return int(main() or 0)

    from functools import partial

    from megatron.core.enums import ModelType
    from megatron.training import initialize, training

    original_initialize = initialize.initialize_megatron
    training.initialize_megatron = partial(original_initialize, allow_no_cuda=True)
    import pretrain_gpt
    from gpt_builders import gpt_builder
    from model_provider import model_provider

    def datasets(_num_samples: Any) -> tuple[Any, None, None]:
        return _Rows(os.environ["BENCH_ROWS"], rank, torch.distributed.get_world_size()), None, None

    datasets.is_distributed = True  # type: ignore[attr-defined]
    training.pretrain(datasets, partial(model_provider, gpt_builder), ModelType.encoder_or_decoder,
                      pretrain_gpt.forward_step)
    return 0


# ---------------------------------------------------------------- the benchmark driver

def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def _windows(train_jsonl: Path, tokenizer: Path, seq_length: int, out: Path) -> None:
    """The demo chats' tokens and loss masks, concatenated and cut into seq+1 windows."""
    import numpy as np
    import torch

    from megatron_packing.data import load_sft_dataset

    ds = load_sft_dataset(str(train_jsonl), str(tokenizer), cache_dir=out.parent / "win_cache",
                          show_progress=False)
    ids = np.concatenate([ds[i]["input_ids"] for i in range(len(ds))])
    mask = np.concatenate([ds[i]["loss_mask"] for i in range(len(ds))])
    n = len(ids) // (seq_length + 1)
    shape = (n, seq_length + 1)
    torch.save({"tokens": torch.from_numpy(ids[: n * (seq_length + 1)].reshape(shape).copy()),
                "loss_mask": torch.from_numpy(mask[: n * (seq_length + 1)].reshape(shape).copy())},
               out)


class Session:
    """Launches the three kinds of run and reads their rank-0 step times."""

    def __init__(self, tmp: Path, old_tree: Path, iters: int, batch: int) -> None:
        from megatron_lm_runs import MEGATRON_LM, MODEL_ARGS, write_sft_yaml

        self.tmp, self.iters, self.batch = tmp, iters, batch
        self.model_args, self.megatron = MODEL_ARGS, MEGATRON_LM
        self.trees = {"after": ROOT, "before": old_tree}
        self.yaml = {}
        chats = (ROOT / "examples" / "data" / "demo_chat.jsonl").read_text().splitlines()
        for name in self.trees:
            data = tmp / name
            data.mkdir()
            (data / "train.jsonl").write_text("\n".join(chats) + "\n")
            (data / "valid.jsonl").write_text("\n".join(chats[:32]) + "\n")
            self.yaml[name] = write_sft_yaml(data / "sft.yaml", data)
        self.rows_file = tmp / "windows.pt"
        self.seq_length = int(MODEL_ARGS[MODEL_ARGS.index("--seq-length") + 1])
        _windows(tmp / "after" / "train.jsonl", ROOT / "examples" / "tokenizer", self.seq_length,
                 self.rows_file)
        self.rows_per_rank: int | None = None
        self.port = 29000 + (os.getpid() % 500) * 2
        self.count = 0

    def run(self, name: str) -> dict[str, Any]:
        """One run; per measured step: period, schedule, optimizer ms and rows on rank 0."""
        self.count += 1
        out = self.tmp / f"run{self.count}_{name}"
        out.mkdir()
        project = ROOT if name == "pretrain" else self.trees[name]
        common = ["--train-iters", str(self.iters), "--eval-iters", "0", "--eval-interval",
                  str(self.iters)]
        if name == "pretrain":
            assert self.rows_per_rank is not None
            extra = [*common, "--dataloader-type", "external",
                     "--global-batch-size", str(2 * self.rows_per_rank)]
        else:
            extra = [*common, "--packing-config", str(self.yaml[name]), "--global-batch-size",
                     str(self.batch), "--packing-log-dir", str(out / "log")]
        self.port += 1
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                   f"--master-port={self.port}", str(Path(__file__).resolve()),
                   *self.model_args, *extra]
        env = dict(os.environ)
        env.update({
            "PYTHONPATH": os.pathsep.join([str(self.megatron), str(project)]),
            WORKER_ENV: "pretrain" if name == "pretrain" else "entry",
            "BENCH_SHIMS_DIR": str(project / "tests" / "megatron_lm"),
            "BENCH_PROJECT": str(project), "BENCH_TIMES_DIR": str(out),
            "BENCH_ROWS": str(self.rows_file), "CUDA_DEVICE_MAX_CONNECTIONS": "1",
            "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"})
        started = time.perf_counter()
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            raise SystemExit(f"{name} run failed:\n{(proc.stdout + proc.stderr)[-6000:]}")
        times = json.loads((out / "times_rank0.json").read_text())
        starts = [entry[0] for entry in times["schedule"]]
        if len(starts) != self.iters or len(times["optimizer"]) != self.iters:
            raise SystemExit(f"{name}: {len(starts)} schedules and {len(times['optimizer'])} "
                             f"optimizer steps timed, expected {self.iters}")
        if name == "pretrain":
            rows = [self.rows_per_rank] * self.iters
            tokens = [float(self.seq_length)] * self.iters
            fetch = [None] * self.iters  # pretrain_gpt fetches each row inside forward_step
        else:
            from megatron_lm_runs import read_records

            steps = [r for r in read_records(out / "log")[0] if "examples" in r]
            rows = [s["micro_batches"] for s in steps]
            tokens = [statistics.mean(s["row_lengths"]) for s in steps]
            fetch = [s["data_ms"] for s in steps]  # the loop's wait for the step's batch
            if self.rows_per_rank is None:
                self.rows_per_rank = round(statistics.median(rows))
        # Step i's time: from its schedule's start to the next one's; the first two are warm-up.
        steps_out = []
        for i in range(2, self.iters - 1):
            steps_out.append({"period": (starts[i + 1] - starts[i]) * 1000,
                              "schedule": times["schedule"][i][1],
                              "forward": times["schedule"][i][2],
                              "backward": times["schedule"][i][3],
                              "optimizer": times["optimizer"][i][1],
                              "rows": rows[i], "tokens": tokens[i], "fetch": fetch[i]})
        return {"wall": wall, "steps": steps_out}


NAMES = {"pretrain": "Megatron pretrain()", "before": "packing loop before",
         "after": "packing loop after"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=35)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--global-batch-size", type=int, default=32,
                        help="examples per step of the packing runs")
    parser.add_argument("--before", default="30ae8f8", help="commit of the 'before' loop")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests" / "megatron_lm"))
    from megatron_lm_runs import SKIP_REASON

    if SKIP_REASON:
        raise SystemExit(f"skipped: {SKIP_REASON}")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from report import Report

    report = Report(args.out)
    report.print(f"Machine: {os.cpu_count()} CPUs (nproc), load average "
                 f"{os.getloadavg()[0]:.1f} at start. Tiny GPT (2 layers, hidden 32, seq 256), "
                 f"2 DP ranks (gloo, CPU), {args.iters} iterations per run, {args.rounds} rounds "
                 f"interleaved (after, pretrain, before); packing B={args.global_batch_size} "
                 f"examples per step; before = commit {args.before}.")
    report.print("")
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in NAMES}
    walls: dict[str, list[float]] = {name: [] for name in NAMES}
    with tempfile.TemporaryDirectory(prefix="bench_vs_pretrain_") as tmp_name:
        tmp = Path(tmp_name)
        old_tree = tmp / "old-loop"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old_tree),
                        args.before], check=True, capture_output=True)
        try:
            session = Session(tmp, old_tree, args.iters, args.global_batch_size)
            for round_ in range(args.rounds):
                for name in ("after", "pretrain", "before"):
                    run = session.run(name)
                    results[name] += run["steps"]
                    walls[name].append(run["wall"])
                    print(f"  round {round_ + 1} {NAMES[name]}: wall {run['wall']:.1f} s, median "
                          f"{statistics.median(s['period'] for s in run['steps']):.1f} ms/step",
                          flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(old_tree)], check=False, capture_output=True)
    assert session.rows_per_rank is not None
    report.print(f"Megatron pretrain() rows per rank per step: {session.rows_per_rank} (fixed; "
                 "the median of the first packing run); its rows are full "
                 f"{session.seq_length}-token windows. The packing rows vary in count and length "
                 "(packed bins, at most 256 tokens).")
    report.print(f"Per step, rank 0, steps 3..{args.iters - 1} of each run, pooled over "
                 f"{args.rounds} runs each:")
    report.print("")
    report.print("| run | step median ms | step p99 ms | schedule ms | fwd ms/row | bwd ms/row | "
                 "optimizer ms | loop + data ms | of it batch fetch ms | rows/rank | tokens/row | "
                 "ms per row | step vs pretrain | ms/row vs pretrain | loop+data vs pretrain |")
    report.print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    base: dict[str, float] = {}
    for name in ("pretrain", "before", "after"):
        steps = results[name]
        period = [s["period"] for s in steps]
        rest = [s["period"] - s["schedule"] - s["optimizer"] for s in steps]
        per_row = [s["period"] / s["rows"] for s in steps]
        row = {"step": statistics.median(period), "row": statistics.median(per_row),
               "rest": statistics.median(rest)}
        if name == "pretrain":
            base = row
            fetch_ms = "in fwd"
        else:
            fetch_ms = f"{statistics.median(s['fetch'] for s in steps):.1f}"
        report.print(
            f"| {NAMES[name]} | {row['step']:.1f} | {_p99(period):.1f} | "
            f"{statistics.median(s['schedule'] for s in steps):.1f} | "
            f"{statistics.median(s['forward'] / s['rows'] for s in steps):.1f} | "
            f"{statistics.median(s['backward'] / s['rows'] for s in steps):.1f} | "
            f"{statistics.median(s['optimizer'] for s in steps):.1f} | {row['rest']:.1f} | "
            f"{fetch_ms} | "
            f"{statistics.median(s['rows'] for s in steps):g} | "
            f"{statistics.median(s['tokens'] for s in steps):.0f} | {row['row']:.1f} | "
            f"{row['step'] / base['step']:.2f} | {row['row'] / base['row']:.2f} | "
            f"{row['rest'] / base['rest']:.2f} |")
    report.print("")
    report.print("Run wall times (s, start-up included): " + "; ".join(
        f"{NAMES[n]} " + ", ".join(f"{w:.0f}" for w in walls[n]) for n in NAMES))
    report.print("")
    report.print("Reading it: step = wall time between consecutive schedule starts on rank 0 "
                 "(everything the loop does per step). schedule = megatron-core's "
                 "forward-backward over the step's rows (fwd / bwd ms/row: its forward_step "
                 "(batch, model, loss) and backward_step per row); optimizer = optimizer.step(); "
                 "loop + data = step - schedule - optimizer (Megatron: its train_step "
                 "bookkeeping, training_log, per-step callbacks; packing: the batch fetch "
                 "(its data_ms record, shown apart), micro-batch sync, metrics, the step log "
                 "and, after, Megatron's training_log and callbacks). pretrain_gpt fetches "
                 "each row inside forward_step (fwd ms/row), so its loop + data holds no "
                 "fetch. pretrain()'s rows are a fixed "
                 "count of full windows, the packing rows vary per step and are shorter, so "
                 "the whole-step ratio mixes work and overhead; the loop + data column and "
                 "ms per row are the ones to compare.")
    report.save()


if __name__ == "__main__":
    if os.environ.get(WORKER_ENV):
        sys.exit(_worker())
    main()
