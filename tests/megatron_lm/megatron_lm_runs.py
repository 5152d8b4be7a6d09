"""Helpers and the shared data fixture for tests that drive Megatron-LM's own training package.

Where the package comes from:

* ``MEGATRON_LM_PATH`` set to a Megatron-LM checkout's root: that checkout (its folder goes on
  ``PYTHONPATH``, so its ``model_provider`` / ``gpt_builders`` build the model);
* ``MEGATRON_LM_PATH`` set but empty: no checkout; the installed megatron-core's own
  ``megatron.training`` (0.19 and newer ship it) and the library's GPT provider;
* unset: the installed megatron-core's ``megatron.training`` when its wheel ships one, else the
  checkout at ``../shared/third_party/megatron-lm`` beside the project (tag core_v0.16.1).

Without a usable training package these tests skip, naming what is missing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[2]
DEFAULT_MEGATRON_LM = PROJECT.parent / "shared" / "third_party" / "megatron-lm"
RUN_CPU = Path(__file__).with_name("run_cpu.py")


def _installed_training() -> bool:
    """Whether the installed megatron-core ships ``megatron.training`` (0.19 and newer)."""
    return any((Path(entry) / "megatron" / "training" / "training.py").is_file()
               and (Path(entry) / "megatron" / "core" / "package_info.py").is_file()
               for entry in sys.path if entry)


def _checkout() -> Path | None:
    given = os.environ.get("MEGATRON_LM_PATH")
    if given is not None:
        return Path(given) if given else None
    return None if _installed_training() else DEFAULT_MEGATRON_LM


# The Megatron-LM checkout the tests run (None: the installed megatron-core's megatron.training
# and the library's GPT provider).
MEGATRON_LM: Path | None = _checkout()


def _missing() -> str | None:
    if MEGATRON_LM is None:
        if not _installed_training():
            return ("MEGATRON_LM_PATH is empty (no checkout) and the installed megatron-core "
                    "ships no megatron.training (0.19 and newer do)")
    elif not (MEGATRON_LM / "megatron" / "training" / "training.py").is_file():
        return (f"Megatron-LM's training package not found at {MEGATRON_LM} "
                "(set MEGATRON_LM_PATH to a Megatron-LM checkout)")
    for module in ("six", "einops", "triton", "tensorboard"):
        if importlib.util.find_spec(module) is None:
            return f"Megatron-LM needs the `{module}` package (pip install {module})"
    return None


SKIP_REASON = _missing()
requires_megatron_lm = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

# A tiny GPT on CPU: Megatron-LM's own arguments, with the flags its CPU path needs.
MODEL_ARGS = shlex.split(
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 256 "
    "--max-position-embeddings 256 --micro-batch-size 1 --lr 3e-3 --min-lr 3e-4 "
    "--lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01 "
    "--tokenizer-type NullTokenizer --vocab-size 2815 "
    "--transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion "
    "--use-cpu-initialization --no-masked-softmax-fusion --no-bias-gelu-fusion "
    "--no-bias-dropout-fusion --no-rope-fusion --distributed-backend gloo "
    "--position-embedding-type learned_absolute --calculate-per-token-loss "
    "--rerun-mode disabled --clip-grad 0 --attention-dropout 0 --hidden-dropout 0 --seed 1234 "
    "--log-interval 1 --no-load-rng --distributed-timeout-minutes 3"
)


@dataclass
class Run:
    """One finished (or killed) launch: its output and per-rank step records."""

    returncode: int
    output: str
    log_dir: Path
    records: dict[int, list[dict]] = field(default_factory=dict)

    def steps(self, rank: int = 0) -> list[dict]:
        """Training-step records of one global rank, by iteration."""
        return [r for r in self.records.get(rank, []) if "examples" in r]

    def evaluations(self, rank: int = 0) -> list[dict]:
        return [r for r in self.records.get(rank, []) if "valid_loss" in r]


def read_records(log_dir: Path) -> dict[int, list[dict]]:
    """Each rank's records; a last line that a kill cut short is left out."""
    records = {}
    for path in sorted(log_dir.glob("steps_rank*.jsonl")):
        rank = int(path.stem.removeprefix("steps_rank"))
        records[rank] = [json.loads(line) for line in path.read_text().splitlines()
                         if line.endswith("}")]
    return records


def _env() -> dict[str, str]:
    env = dict(os.environ)
    checkout = [] if MEGATRON_LM is None else [str(MEGATRON_LM)]
    env["PYTHONPATH"] = os.pathsep.join([*checkout, str(PROJECT), env.get("PYTHONPATH", "")])
    env.update(CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="1", WANDB_MODE="disabled",
               PYTHONUNBUFFERED="1")
    return env


# A launch's ranks tear the interpreter down in full (see run_cpu.py).
FULL_EXIT = {"MEGATRON_PACKING_TEST_FULL_EXIT": "1"}

_PORT = [29600 + (os.getpid() % 200) * 5]


def torchrun_command(nproc: int, args: list[str]) -> list[str]:
    _PORT[0] += 1
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--master-port={_PORT[0]}", str(RUN_CPU), *MODEL_ARGS, *args]


def launch(nproc: int, args: list[str], log_dir: Path, *, timeout: float = 240,
           env: dict[str, str] | None = None) -> Run:
    """Run the entry point under torchrun to completion."""
    proc = subprocess.run(torchrun_command(nproc, [*args, "--packing-log-dir", str(log_dir)]),
                          env={**_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)
    output = proc.stdout + proc.stderr
    return Run(proc.returncode, output, log_dir, read_records(log_dir))


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, frontier = [], [pid]
    while frontier:
        below = children.get(frontier.pop(), [])
        found += below
        frontier += below
    return found


def drain(proc: subprocess.Popen):
    """Read ``proc``'s output as it comes (a full pipe would block the ranks' writes: megatron-core
    0.19 warns far more than 0.16 at start-up); returns the function that gives it all once the
    process has ended."""
    chunks: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: chunks.extend(iter(proc.stdout.readline, "")),
                              daemon=True)
    reader.start()

    def collected() -> str:
        reader.join(timeout=60)
        return "".join(chunks)

    return collected


def launch_and_kill(nproc: int, args: list[str], log_dir: Path, *, kill_when,
                    timeout: float = 240) -> Run:
    """Start the entry point; once ``kill_when(log_dir)``, SIGKILL torchrun and every rank.

    That is what a scheduler's job kill (or a node loss) does: no process gets to clean up.
    """
    proc = subprocess.Popen(torchrun_command(nproc, [*args, "--packing-log-dir", str(log_dir)]),
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    output_of = drain(proc)
    deadline = time.monotonic() + timeout
    try:
        while not kill_when(log_dir):
            if proc.poll() is not None:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("the run never reached the kill point")
            time.sleep(0.02)
    finally:
        for pid in [proc.pid, *descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        output = output_of()
    return Run(proc.returncode, output, log_dir, read_records(log_dir))


def rank_processes(launcher_pid: int) -> list[int]:
    """The training ranks torchrun started (not their checkpoint-writer helpers)."""
    ranks = []
    for pid in descendants(launcher_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(part.endswith(b"run_cpu.py") for part in cmdline):
            ranks.append(pid)
    return ranks


def launch_and_signal(nproc: int, args: list[str], log_dir: Path, *, signal_when,
                      sig: signal.Signals = signal.SIGTERM, timeout: float = 240) -> Run:
    """Start the entry point; once ``signal_when(log_dir)``, send ``sig`` to every rank (as a
    cluster scheduler does before preempting a job) and wait for the job to end by itself."""
    launcher: list[int] = []

    def signal_every_rank() -> None:
        ranks = rank_processes(launcher[0])
        assert len(ranks) == nproc, f"found {len(ranks)} ranks, expected {nproc}"
        for pid in ranks:
            os.kill(pid, sig)

    return launch_and_act(nproc, args, log_dir, act_when=signal_when, action=signal_every_rank,
                          timeout=timeout, started=launcher.append)


def launch_and_act(nproc: int, args: list[str], log_dir: Path, *, act_when, action,
                   timeout: float = 240, env: dict[str, str] | None = None,
                   started=None) -> Run:
    """Start the entry point; once ``act_when(log_dir)``, call ``action()`` (an operator's
    command, or a scheduler's signal, while the job runs) and wait for the job to end by itself.
    ``started(pid)`` hears torchrun's process id."""
    proc = subprocess.Popen(torchrun_command(nproc, [*args, "--packing-log-dir", str(log_dir)]),
                            env={**_env(), **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output_of = drain(proc)
    if started is not None:
        started(proc.pid)
    deadline = time.monotonic() + timeout
    acted = False
    try:
        while proc.poll() is None and not acted:
            if act_when(log_dir):
                action()
                acted = True
            elif time.monotonic() > deadline:
                raise TimeoutError("the run never reached the point to act")
            time.sleep(0.02)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        output = output_of()
    finally:
        if proc.poll() is None:
            for pid in [proc.pid, *descendants(proc.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
    assert acted, "the run ended before the point to act"
    return Run(proc.returncode, output, log_dir, read_records(log_dir))


def logged_iterations(log_dir: Path, rank: int = 0) -> int:
    """The last training iteration a rank has recorded so far."""
    path = log_dir / f"steps_rank{rank}.jsonl"
    if not path.exists():
        return 0
    done = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return max((r["iteration"] for r in done if "examples" in r), default=0)


PACKED_KEYS = {"align_packing_bins_to_dp": True, "packing_batch_size_allowed_variation": 0.2,
               "oversize_policy": "truncate"}


def write_sft_yaml(path: Path, data_dir: Path, *, padded: bool = False,
                   tokenizer: Path | None = None, cache: Path | None = None,
                   **packing: object) -> Path:
    """A training YAML over a slice of the shipped demo chats and tokenizer: packed and DP-aligned,
    or with ``padded`` the padded mode (``use_sequence_packing: false``), plus ``packing`` keys;
    ``tokenizer`` and ``cache`` replace the demo tokenizer and ``data_dir/cache``."""
    base = {"use_sequence_packing": False} if padded else PACKED_KEYS
    lines = ["packing:", *(f"  {key}: {json.dumps(value)}"
                           for key, value in {**base, "seed": 1234, **packing}.items())]
    lines += ["data:", f"  paths: [{data_dir / 'train.jsonl'}]",
              f"  valid_paths: [{data_dir / 'valid.jsonl'}]",
              f"  tokenizer: {tokenizer or PROJECT / 'examples' / 'tokenizer'}",
              f"  cache_dir: {cache or data_dir / 'cache'}"]
    path.write_text("\n".join(lines) + "\n")
    return path


# The reference run of the DP-2 loop tests (tests/megatron_lm/conftest.py runs it once).
B, DP, ITERS = 16, 2, 8


def reference_args(yaml: Path, save: Path, *extra: str) -> list[str]:
    """The reference's training arguments (saving every 4 iterations, torch_dist)."""
    return ["--packing-config", str(yaml), "--global-batch-size", str(B),
            "--train-iters", str(ITERS), "--save", str(save), "--save-interval", "4", *extra]


# Megatron's logging, per-step callbacks and manual GC, all on in the reference run.
LOGGING = ["--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard",
           "--log-params-norm", "--log-num-zeros-in-grad", "--log-world-size-to-tensorboard",
           "--log-throughput", "--timing-log-level", "1", "--tensorboard-log-interval", "1",
           "--check-weight-hash-across-dp-replicas-interval", "4", "--train-sync-interval", "2",
           "--manual-gc", "--manual-gc-interval", "2"]


def same_steps(got_steps: list[dict], want_steps: list[dict], *, rel: float = 1e-6) -> None:
    """A resumed run's steps equal the uninterrupted run's: examples, consumed, LR, loss."""
    assert [s["iteration"] for s in got_steps] == [s["iteration"] for s in want_steps]
    for got, want in zip(got_steps, want_steps, strict=True):
        assert got["examples"] == want["examples"]
        assert got["consumed_train_samples"] == want["consumed_train_samples"]
        assert got["lr"] == want["lr"]
        if want["loss"] is None:
            assert got["loss"] is None
        else:
            assert got["loss"] == pytest.approx(want["loss"], rel=rel)


def tracker_says(save: Path, iteration: int):
    def reached(log_dir: Path) -> bool:
        tracker = save / "latest_checkpointed_iteration.txt"
        return tracker.exists() and tracker.read_text().strip() == str(iteration)

    return reached


@pytest.fixture(scope="session")
def sft_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """600 training and 64 validation chats from the demo data."""
    if SKIP_REASON is not None:
        pytest.skip(SKIP_REASON)
    out = tmp_path_factory.mktemp("megatron_lm_data")
    chats = (PROJECT / "examples" / "data" / "demo_chat.jsonl").read_text().splitlines()
    (out / "train.jsonl").write_text("\n".join(chats[:600]) + "\n")
    (out / "valid.jsonl").write_text("\n".join(chats[600:664]) + "\n")
    return out


SLOW_BUILD_SECONDS = 80.0
"""How long `write_slow_build_data`'s build is sized to take: well over a 60 s timeout."""
CALIBRATION_RECORDS = 400


def _slow_build_conversations(records: int) -> list[str]:
    """``records`` conversations, each four demo chats in a row."""
    chats = (PROJECT / "examples" / "data" / "demo_chat.jsonl").read_text().splitlines()
    joined = []
    for k in range(records):
        messages = []
        for j in range(4):
            messages += json.loads(chats[(4 * k + j) % 2900])["messages"]
        joined.append(json.dumps({"messages": messages}))
    return joined


def write_slow_build_data(out: Path, seconds: float = SLOW_BUILD_SECONDS, *,
                          sharers: int = 1) -> tuple[Path, int]:
    """Training data whose length index takes about ``seconds`` to build on this machine (a
    real build) by ``sharers`` processes sharing it (at best that many times faster than one),
    and its record count: the demo tokenizer with a chat template without
    generation tags, so every assistant turn's mask comes from rendering and tokenizing its
    prefix (the prefix fallback), and conversations of four demo chats each, as many as this
    machine builds in ``seconds`` (its rate measured here on `CALIBRATION_RECORDS` of them, so a
    faster machine gets more), plus 64 validation chats."""
    import shutil

    from megatron_packing.data import load_sft_dataset
    from megatron_packing.data.length_index import PARALLEL_MIN_RECORDS

    chats = (PROJECT / "examples" / "data" / "demo_chat.jsonl").read_text().splitlines()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = out / "tokenizer"
    shutil.copytree(PROJECT / "examples" / "tokenizer", tokenizer, dirs_exist_ok=True)
    template = tokenizer / "chat_template.jinja"
    template.write_text(template.read_text().replace("{% generation %}", "")
                        .replace("{% endgeneration %}", ""))
    sample, cache = out / "calibration.jsonl", out / "calibration_cache"
    rates = []
    for count in (CALIBRATION_RECORDS // 4, CALIBRATION_RECORDS):  # the first warms up
        sample.write_text("\n".join(_slow_build_conversations(count)) + "\n")
        shutil.rmtree(cache, ignore_errors=True)  # a real build every time, never a cache hit
        began = time.perf_counter()
        load_sft_dataset([str(sample)], str(tokenizer), cache_dir=str(cache), num_proc=1,
                         show_progress=False)
        rates.append(count / (time.perf_counter() - began))
    sample.unlink()
    shutil.rmtree(cache)
    rate = rates[-1]
    records = int(rate * seconds * sharers) + 1
    if records >= PARALLEL_MIN_RECORDS:  # the job's build then runs min(CPUs, 8) processes: at
        # best that many times faster than one, so the build still takes at least ``seconds``
        records *= min(os.cpu_count() or 1, 8)
    (out / "train.jsonl").write_text("\n".join(_slow_build_conversations(records)) + "\n")
    (out / "valid.jsonl").write_text("\n".join(chats[2900:2964]) + "\n")
    return out, records
