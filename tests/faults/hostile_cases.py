"""A catalogue of hostile inputs, each run for real and its outcome classified.

Outcomes: ``correct`` (valid input, right result), ``clear`` (refused with one message naming
what is wrong: the expected fragment is in it and the error is one of the library's own),
``unclear`` (refused, but the message lacks the fragment), ``traceback`` (a raw Python error
a user should never see), ``silent`` (accepted although it should not be, or a wrong result),
``lost`` (a finished run's files changed), ``hang`` (a command past its time limit).

Each case names the mechanism that handles it. `run_cases` runs the in-process cases; the
``cli`` and ``ranks`` groups start processes (``scripts/hostile_catalogue.py`` runs them all).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "examples" / "tokenizer"
DEMO_DATA = REPO / "examples" / "data" / "demo_chat.jsonl"
LIBRARY_ERRORS = ("ConfigError", "BadRecordError", "CheckpointError", "CorruptStoreError",
                  "FetchedExampleError", "RankFailed", "OutputDirHoldsRun", "TrainingError")


@dataclass
class Case:
    name: str
    mechanism: str
    run: Callable[[Path], Any]  # returns a value (accepted) or raises
    fragment: str | None = None  # refusal expected, with this in its message
    check: Callable[[Any], bool] | None = None  # accepted: is the result right?
    group: str = "library"


def classify(case: Case, tmp: Path) -> tuple[str, str]:
    """(outcome, detail) of one case."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = case.run(tmp)
    except subprocess.TimeoutExpired:
        return "hang", "timed out"
    except Exception as exc:  # noqa: BLE001 - classifying every outcome is the point
        if case.fragment is None:
            return "silent" if case.check else "traceback", f"{type(exc).__name__}: {exc}"[:200]
        message = str(exc)
        named = type(exc).__name__ in LIBRARY_ERRORS or "load_state_dict" in message or (
            isinstance(exc, ValueError) and case.fragment in message)
        if not named:
            return "traceback", f"{type(exc).__name__}: {message}"[:200]
        return ("clear" if case.fragment in message else "unclear"), message[:200]
    if isinstance(result, CliResult):
        return result.outcome(case.fragment)
    if case.fragment is not None:
        shown = [str(w.message) for w in caught if case.fragment in str(w.message)]
        if shown:
            return "clear", f"warning: {shown[0][:180]}"
        return "silent", f"accepted: {result!r:.120}"
    if case.check is not None and not case.check(result):
        return "silent", f"wrong result: {result!r:.120}"
    return "correct", ""


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str
    lost: bool = False
    expect_ok: bool = False

    def outcome(self, fragment: str | None) -> tuple[str, str]:
        if self.lost:
            return "lost", "a finished run's files changed"
        text = self.stdout + self.stderr
        if "Traceback" in self.stderr:
            return "traceback", self.stderr[-200:]
        if self.expect_ok:
            ok = self.returncode == 0 and (fragment is None or fragment in text)
            return ("correct", "") if ok else ("silent", text[-200:])
        if self.returncode == 0:
            return "silent", f"exit 0: {text[-160:]}"
        return ("clear" if fragment and fragment in self.stderr else "unclear"), self.stderr[-200:]


# ---------------------------------------------------------------------------- helpers
def _yaml(tmp: Path, text: str | bytes, name: str = "c.yaml") -> Path:
    path = tmp / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def _load(text: str | bytes) -> Callable[[Path], Any]:
    def run(tmp: Path) -> Any:
        from megatron_packing.config import load_config

        return load_config(_yaml(tmp, text))
    return run


def _packing(**keys: Any) -> Callable[[Path], Any]:
    def run(tmp: Path) -> Any:
        from megatron_packing.config import PackingConfig

        return PackingConfig.from_dict(keys, source="c.yaml")
    return run


def _training_doc(tmp: Path, **changes: Any) -> dict:
    subset = tmp / "demo.jsonl"
    if not subset.exists():
        subset.write_text("".join(DEMO_DATA.read_text().splitlines(keepends=True)[:40]))
    doc: dict[str, Any] = {
        "packing": {"global_batch_size": 8, "bin_capacity": 256, "align_packing_bins_to_dp": True,
                    "packing_batch_size_allowed_variation": 0.25, "oversize_policy": "truncate"},
        "data": {"paths": [str(subset)], "tokenizer": str(TOKENIZER),
                 "cache_dir": str(tmp / "cache")},
        "model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2},
        "train": {"steps": 2, "lr": 0.01, "warmup_steps": 1, "dp_size": 2},
        "logging": {"wandb": False, "plot": False},
    }
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        doc[section][key] = value
    return doc


def _training(**changes: Any) -> Callable[[Path], Any]:
    def run(tmp: Path) -> Any:
        from megatron_packing.config.training import load_training_config

        path = _yaml(tmp, yaml.safe_dump(_training_doc(tmp, **changes)))
        return load_training_config(path)
    return run


def _workers(**options: Any) -> Callable[[Path], Any]:
    def run(tmp: Path) -> Any:
        from megatron_packing.loader.dataloader import WorkerConfig

        return WorkerConfig(**options)
    return run


def _records(records: list, **options: Any) -> Callable[[Path], Any]:
    def run(tmp: Path) -> Any:
        from megatron_packing.data import load_sft_dataset

        path = tmp / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return load_sft_dataset(path, str(TOKENIZER), cache_dir=tmp / "cache",
                                show_progress=False, **options)
    return run


def _turns(*weights: Any) -> dict:
    messages = []
    for k, weight in enumerate(weights):
        messages.append({"role": "user", "content": f"What is {k} + 30?"})
        answer: dict[str, Any] = {"role": "assistant", "content": f"It is {k + 30}."}
        if weight != "none":
            answer["weight"] = weight
        messages.append(answer)
    return {"messages": messages}


def _tool(arguments: Any) -> dict:
    return {"messages": [{"role": "user", "content": "add"}, {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "add",
                                                              "arguments": arguments}}]}]}


class _Duck:
    def __init__(self, examples: list) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict:
        return self.examples[i]


def _ex(n: int, loss_from: int = 1) -> dict:
    mask = np.zeros(n, np.uint8)
    mask[loss_from:] = 1
    return {"input_ids": np.arange(1, n + 1), "loss_mask": mask}


def _duck_loader(examples: list, packed: bool = True) -> Callable[[Path], Any]:
    def run(tmp: Path) -> Any:
        from megatron_packing.config import PackingConfig
        from megatron_packing.loader.dataloader import build_sft_dataloader

        config = PackingConfig(global_batch_size=2, bin_capacity=64, use_sequence_packing=packed)
        return build_sft_dataloader(_Duck(examples), config, dp_rank=0, dp_size=1)
    return run


def _samplers() -> tuple[Any, Any]:
    from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler
    from megatron_packing.padded.sampler import TokenBudgetBatchSampler
    from megatron_packing.stream.base_order import SequentialSampler

    packed = DPAlignedPackingBatchSampler(SequentialSampler(range(8)), [5] * 8, 4, 2,
                                          bin_capacity=16, allowed_variation=0.25, dp_rank=0)
    padded = TokenBudgetBatchSampler(SequentialSampler(range(8)), [5] * 8, 4, 2, dp_rank=0)
    return packed, padded


def _state(mode: str, into: str, **changes: Any) -> Callable[[Path], Any]:
    def run(tmp: Path) -> Any:
        source = dict(zip(("packed", "padded"), _samplers(), strict=True))[mode]
        next(iter(source))
        state = {**source.state_dict(), **changes}
        target = dict(zip(("packed", "padded"), _samplers(), strict=True))[into]
        target.load_state_dict(state)
        return target.state_dict()["step"]
    return run


def _checkpoints(steps: tuple[int, ...], damage: Callable[[Path], None],
                 setup_now: dict | None = None) -> Callable[[Path], Any]:
    def run(tmp: Path) -> Any:
        from megatron_packing.demo import checkpoint as ckpt

        for step in steps:
            ckpt.save_checkpoint(tmp, step, 0, {"x": step}, keep=10,
                                 setup={"train.lr": 0.01, "model.hidden_size": 32})
        damage(tmp)
        chosen, notes = ckpt.find_resume_checkpoint(tmp, 1)
        if setup_now is not None and chosen is not None:
            ckpt.check_setup(chosen, setup_now)
        return chosen.name if chosen else None, notes
    return run


def _root(tmp: Path) -> Path:
    return tmp / "checkpoints"


def _cli(args: list[str], *, timeout: float = 300, expect_ok: bool = False,
         prepare: Callable[[Path], list[str]] | None = None,
         guard: Callable[[Path], Any] | None = None) -> Callable[[Path], Any]:
    def run(tmp: Path) -> CliResult:
        extra = prepare(tmp) if prepare else []
        before = guard(tmp) if guard else None
        env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline"}
        done = subprocess.run([sys.executable, "-m", "megatron_packing.cli", *args, *extra],
                              capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp)
        lost = guard is not None and guard(tmp) != before
        return CliResult(done.returncode, done.stdout, done.stderr, lost, expect_ok)
    return run


def _fake_run(tmp: Path) -> list[str]:
    out = tmp / "out"
    (out / "checkpoints" / "step_000002").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    (out / "summary.json").write_text("{}")
    _yaml(tmp, yaml.safe_dump(_training_doc(tmp)), "t.yaml")
    return ["--config", "t.yaml", "--output-dir", "out", "--no-wandb"]


def _run_files(tmp: Path) -> tuple:
    out = tmp / "out"
    return tuple(sorted((str(p.relative_to(out)), p.read_bytes() if p.is_file() else b"")
                        for p in out.rglob("*") if p.name != ".run.lock")) if out.exists() else ()


def _with_dup(tmp: Path) -> list[str]:
    text = yaml.safe_dump(_training_doc(tmp)) + "packing:\n  seed: 4\n"
    _yaml(tmp, text, "t.yaml")
    return ["--config", "t.yaml"]


def _training_file(**changes: Any) -> Callable[[Path], list[str]]:
    def prepare(tmp: Path) -> list[str]:
        _yaml(tmp, yaml.safe_dump(_training_doc(tmp, **changes)), "t.yaml")
        return ["--config", "t.yaml"]
    return prepare


def _broken_tokenizer(tmp: Path) -> Any:
    from megatron_packing.data.tokenize import load_tokenizer

    broken = tmp / "tok"
    broken.mkdir()
    for name in os.listdir(TOKENIZER):
        (broken / name).write_bytes((TOKENIZER / name).read_bytes())
    (broken / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    return load_tokenizer(str(broken))


def _ranks(fn_name: str) -> Callable[[Path], Any]:
    def run(tmp: Path) -> Any:
        from megatron_packing.common.validation import ConfigError
        from megatron_packing.demo.launch import spawn_data_parallel

        sys.path.insert(0, str(REPO / "tests"))
        from faults import rank_helpers

        return spawn_data_parallel(getattr(rank_helpers, fn_name), 2, refusals=(ConfigError,))
    return run


def _dup_train(tmp: Path) -> Any:
    from megatron_packing.config.training import load_training_config

    text = yaml.safe_dump(_training_doc(tmp)) + "train:\n  steps: 9\n"
    return load_training_config(_yaml(tmp, text, "d.yaml"))


# ---------------------------------------------------------------------------- the catalogue
def _weights_honoured(ds: Any) -> bool:
    example = ds[0]
    mask = example["loss_mask"]
    from megatron_packing.data.tokenize import load_tokenizer

    trained = load_tokenizer(str(TOKENIZER)).decode(example["input_ids"][mask == 1])
    return "It is 31." in trained and "It is 30." not in trained


CASES: list[Case] = [
    # -- strict reader
    Case("duplicate key", "strict reader", _load("global_batch_size: 16\nglobal_batch_size: 64\n"),
         "duplicate key 'global_batch_size'"),
    Case("duplicate packing section", "strict reader",
         _load("packing:\n  seed: 1\npacking:\n  seed: 2\n"), "duplicate section 'packing'"),
    Case("duplicate nested key", "strict reader",
         _load("packing:\n  seed: 1\n  bin_capacity: 512\n  seed: 2\n"), "duplicate key 'seed'"),
    Case("duplicate train section (demo)", "strict reader", _dup_train,
         "duplicate section 'train'"),
    Case("non-UTF-8 byte", "strict reader", _load(b"packing:\n  seed: 3 # caf\xe9\n"),
         "not UTF-8 text"),
    Case("config path is a directory", "strict reader",
         lambda tmp: __import__("megatron_packing.config", fromlist=["x"]).load_config(tmp),
         "is a directory, not a config file"),
    Case("missing config file", "strict reader",
         lambda tmp: __import__("megatron_packing.config", fromlist=["x"]).load_config(
             tmp / "none.yaml"), "config file not found"),
    Case("tab in YAML", "strict reader", _load("packing:\n\tseed: 1\n"), "YAML syntax error"),
    Case("top level is a list", "strict reader", _load("- 1\n- 2\n"), "expected a mapping"),
    Case("typo in a key", "strict reader", _load("packing:\n  global_batchsize: 8\n"),
         "did you mean 'global_batch_size'"),
    Case("merge keys", "strict reader",
         lambda tmp: __import__("megatron_packing.config", fromlist=["x"]).read_yaml_mapping(
             _yaml(tmp, "a: &b {x: 1}\nc:\n  <<: *b\n  y: 2\n")),
         check=lambda d: d["c"] == {"x": 1, "y": 2}),
    Case("empty file = defaults", "strict reader", _load(""),
         check=lambda c: c.global_batch_size == 128),
    # -- keys the mode does not read
    Case("micro_batch_size in packed mode", "mode keys", _packing(micro_batch_size=4),
         "micro_batch_size is only read in padded mode"),
    Case("max_tokens_per_microbatch in packed mode", "mode keys",
         _packing(max_tokens_per_microbatch=4096), "only read in padded mode"),
    Case("packing keys in padded mode (warned)", "mode keys",
         _packing(use_sequence_packing=False, packing_algorithm="bfd"),
         "packing_algorithm has no effect in padded mode"),
    Case("micro_batch_size at its default in packed mode", "mode keys",
         _packing(micro_batch_size=1), check=lambda c: c.micro_batch_size == 1),
    Case("to_dict round trip", "mode keys",
         lambda tmp: __import__("megatron_packing.config", fromlist=["x"]).PackingConfig.from_dict(
             __import__("megatron_packing.config", fromlist=["x"]).PackingConfig().to_dict()),
         check=lambda c: c.bin_capacity == 4096),
    Case("prefetch_factor with num_workers 0", "mode keys", _workers(prefetch_factor=4),
         "only applies to loader worker processes"),
    Case("persistent_workers with num_workers 0", "mode keys",
         _workers(persistent_workers=True), "only applies to loader worker processes"),
    Case("prefetch_factor with workers", "mode keys", _workers(num_workers=2, prefetch_factor=4),
         check=lambda w: w.loader_options()["prefetch_factor"] == 4),
    # -- value bounds (internal errors shown raw before)
    Case("seed beyond 64 bits", "value bounds", _packing(seed=2**64), "seed must be at most 2**63 - 1"),
    Case("bin_capacity 2**40", "value bounds", _packing(bin_capacity=2**40),
         "bin_capacity must be at most 2147483647"),
    Case("model.init_seed beyond 64 bits", "value bounds", _training(model__init_seed=2**64),
         "model.init_seed must be at most 2**63 - 1"),
    Case("position table larger than memory", "value bounds",
         _training(model__max_position_embeddings=2**36, model__hidden_size=64),
         "position-embedding table alone would take"),
    Case("string global_batch_size", "value bounds", _packing(global_batch_size="64"),
         "global_batch_size must be an integer"),
    # -- training config
    Case("missing data.valid_paths file", "demo paths",
         _training(data__valid_paths=["/nonexistent/v.jsonl"]), "data.valid_paths[0]"),
    Case("valid_paths not a list", "demo paths", _training(data__valid_paths="v.jsonl"),
         "data.valid_paths must be a list"),
    Case("missing data file", "demo paths", _training(data__paths=["/nonexistent/x.jsonl"]),
         "does not exist"),
    Case("unknown train.seed", "demo paths", _training(train__seed=3), "unknown train key 'seed'"),
    Case("unreadable tokenizer file", "tokenizer", _broken_tokenizer, "cannot be loaded"),
    # -- data meaning
    Case("weight 0 on the first assistant turn", "data rules", _records([_turns(0, 1)]),
         check=_weights_honoured),
    Case("weight 0.5", "data rules", _records([_turns(0.5)]), "weight is 0.5"),
    Case("weight true", "data rules", _records([_turns(True)]), "weight is True"),
    Case("weight on a user message", "data rules",
         _records([{"messages": [{"role": "user", "content": "x", "weight": 0},
                                 {"role": "assistant", "content": "y"}]}]),
         "has a weight; only assistant"),
    Case("weight 0 with loss_on all", "data rules", _records([_turns(0, 1)], loss_on="all"),
         "weight_unsupported"),
    Case("every turn weight 0", "data rules", _records([_turns(0, 0)]), "no_loss_tokens"),
    Case("last turn weight 0, loss_on last_assistant_turn", "data rules",
         _records([_turns(1, 0)], loss_on="last_assistant_turn"), "no_loss_tokens"),
    Case("every turn weight 0, skipped and counted", "data rules",
         _records([_turns(0, 0), _turns(1)], on_bad_record="skip"),
         check=lambda ds: len(ds) == 1 and ds.skipped == {"no_loss_tokens": 1}),
    Case("tool arguments not JSON", "data rules", _records([_tool('{"a": 1,')]),
         "arguments is not valid JSON"),
    Case("tool arguments a JSON list", "data rules", _records([_tool("[1]")]),
         "must hold a JSON object"),
    Case("one-token duck example (packed)", "loss targets", _duck_loader([_ex(6), _ex(1)]),
         "no next-token target"),
    Case("one-token duck example (padded)", "loss targets",
         _duck_loader([_ex(6), _ex(1)], packed=False), "no next-token target"),
    Case("mask zero after position 0", "loss targets", _duck_loader([_ex(6), _ex(5, 5)]),
         "no next-token target"),
    Case("no loss token in the whole dataset", "loss targets",
         _duck_loader([_ex(4, 4), _ex(4, 4)]), "the loss divisor would be 0"),
    Case("no mask, one token", "loss targets",
         _duck_loader([_ex(6), {"input_ids": np.array([3])}]), "no next-token target"),
    # -- sampler states
    Case("packed state with step -1", "state fields", _state("packed", "packed", step=-1),
         "step is -1, expected an integer >= 0"),
    Case("packed state, negative carry", "state fields",
         _state("packed", "packed", carry=[-1]), "carry is [-1]"),
    Case("packed state, carry beyond the data", "state fields",
         _state("packed", "packed", carry=[99]), "beyond the dataset's 8 examples"),
    Case("packed state, float drift", "state fields", _state("packed", "packed", drift=0.5),
         "drift is 0.5"),
    Case("packed state, string step_in_epoch", "state fields",
         _state("packed", "packed", step_in_epoch="1"), "step_in_epoch is '1'"),
    Case("padded state, max_tokens 0", "state fields",
         _state("padded", "padded", max_tokens=0), "max_tokens is 0"),
    Case("padded state into a packed loader", "state fields", _state("padded", "packed"),
         "got a padded-mode state"),
    Case("packed state into a padded loader", "state fields", _state("packed", "padded"),
         "got a packed-mode state"),
    Case("packed state, another seed", "state fields",
         _state("packed", "packed", fingerprint={"seed": 99}), "cannot resume"),
    Case("valid state reloads", "state fields", _state("packed", "packed"),
         check=lambda step: step == 1),
    # -- checkpoints
    Case("latest deleted beside three checkpoints", "checkpoint discovery",
         _checkpoints((2, 4, 6), lambda t: (_root(t) / "latest").unlink()),
         check=lambda r: r[0] == "step_000006" and "latest is missing" in r[1][-1]),
    Case("latest names an older checkpoint", "checkpoint discovery",
         _checkpoints((2, 4), lambda t: (_root(t) / "latest").write_text("step_000002\n")),
         check=lambda r: r[0] == "step_000004"),
    Case("latest names a missing checkpoint", "checkpoint discovery",
         _checkpoints((2, 4), lambda t: (_root(t) / "latest").write_text("step_000009\n")),
         check=lambda r: r[0] == "step_000004"),
    Case("manifest not JSON", "checkpoint discovery",
         _checkpoints((2,), lambda t: (_root(t) / "step_000002" / "manifest.json").write_text("{")),
         "manifest.json cannot be read"),
    Case("manifest without world_size", "checkpoint discovery",
         _checkpoints((2,), lambda t: (_root(t) / "step_000002" / "manifest.json").write_text(
             '{"step": 2, "files": {}}')), "world_size is None"),
    Case("truncated rank file", "checkpoint discovery",
         _checkpoints((2,), lambda t: (_root(t) / "step_000002" / "rank0.pt").write_bytes(b"x")),
         "is damaged: rank0.pt has 1 bytes"),
    Case("changed train.lr on resume", "resume setup",
         _checkpoints((2,), lambda t: None, {"train.lr": 0.02, "model.hidden_size": 32}),
         "train.lr: saved 0.01, now 0.02"),
    Case("changed model shape on resume", "resume setup",
         _checkpoints((2,), lambda t: None, {"train.lr": 0.01, "model.hidden_size": 64}),
         "model.hidden_size: saved 32, now 64"),
    Case("changed loss masks on resume", "resume setup",
         _checkpoints((2,), lambda t: None, {"train.lr": 0.01, "model.hidden_size": 32,
                                             "data.loss_targets_sha256": "abc"}),
         "data.loss_targets_sha256: not recorded"),
    # -- commands (processes, before any rank starts)
    Case("train into a finished run", "no overwrite", _cli(["train"], prepare=_fake_run, guard=_run_files),
         "holds a run (metrics.jsonl, summary.json, checkpoints/)", group="cli"),
    Case("train into a path that is a file", "no overwrite",
         _cli(["train", "--output-dir", "f", "--no-wandb"],
              prepare=lambda t: ((t / "f").write_text("x"), _training_file()(t))[1]),
         "is a file, not a directory", group="cli"),
    Case("--resume with --overwrite", "no overwrite",
         _cli(["train", "--resume", "--overwrite", "--output-dir", "o"],
              prepare=_training_file()),
         "exclude each other", group="cli"),
    Case("inspect with a duplicate section", "strict reader", _cli(["inspect"], prepare=_with_dup),
         "duplicate section 'packing'", group="cli"),
    Case("simulate with a duplicate section", "strict reader",
         _cli(["simulate"], prepare=_with_dup), "duplicate section 'packing'", group="cli"),
    Case("tune with a duplicate section", "strict reader", _cli(["tune"], prepare=_with_dup),
         "duplicate section 'packing'", group="cli"),
    Case("train with a non-UTF-8 config", "strict reader",
         _cli(["train", "--config", "b.yaml"],
              prepare=lambda t: (_yaml(t, b"\xff\xfe", "b.yaml"), [])[1]),
         "not UTF-8 text", group="cli"),
    Case("tune --capacities 1", "tune marks", _cli(
        ["tune", "--capacities", "1", "--no-plot", "--quiet", "--output-dir", "r"],
        prepare=_training_file(), expect_ok=True), "Recommendation: none", group="cli"),
    # -- ranks
    Case("refusal on rank 1", "rank failures", _ranks("refuse_on_rank_1"),
         "rank 1: train.yaml: packing.seed", group="ranks"),
    Case("bug on rank 0 (kept traceback)", "rank failures", _ranks("bug_on_rank_0"),
         "rank 0: KeyError", group="ranks"),
    Case("rank killed by SIGKILL", "rank failures", _ranks("killed_on_rank_1"),
         "killed by SIGKILL", group="ranks"),
]


def run_cases(groups: tuple[str, ...] = ("library",)) -> list[tuple[Case, str, str]]:
    """Run every case of ``groups``, each in a fresh directory; (case, outcome, detail)."""
    results = []
    for case in CASES:
        if case.group not in groups:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            outcome, detail = classify(case, Path(tmp))
        results.append((case, outcome, detail))
    return results


def summary(results: list[tuple[Case, str, str]]) -> tuple[Counter, dict[str, Counter]]:
    counts = Counter(outcome for _, outcome, _ in results)
    by_mechanism: dict[str, Counter] = {}
    for case, outcome, _ in results:
        by_mechanism.setdefault(case.mechanism, Counter())[outcome] += 1
    return counts, by_mechanism


# ---------------------------------------------------------------------------- processes, writes
# Appended: kills of a training run (nothing may outlive it) and writes the OS refuses (one
# message naming the path, the OS error and the last complete checkpoint).
def _kill(target: str, workers: int, when: str) -> Callable[[Path], Any]:
    def run(tmp: Path) -> Any:
        from .process_checks import kill_a_training_run

        killed = kill_a_training_run(tmp, target=target, workers=workers, when=when)
        return [cmd[:100] for _, _, cmd in killed.left] + \
            [f"W&B service {pid}" for pid in killed.services_left]
    return run


def _train_writing(tmp: Path, out: Path, preexec: Callable[[], None] | None = None,
                   **changes: Any) -> CliResult:
    config = _yaml(tmp, yaml.safe_dump(_training_doc(tmp, **changes)), "t.yaml")
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline"}
    done = subprocess.run([sys.executable, "-m", "megatron_packing.cli", "train", "--config",
                           str(config), "--output-dir", str(out), "--no-wandb"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp,
                          preexec_fn=preexec)
    return CliResult(done.returncode, done.stdout, done.stderr)


def _read_only_output(tmp: Path) -> CliResult:
    from .process_checks import read_only_dir

    with read_only_dir(tmp / "out") as out:
        return _train_writing(tmp, out)


def _small_disk(size: str, *, full_at_start: bool = False) -> Callable[[Path], Any]:
    def run(tmp: Path) -> CliResult:
        from .process_checks import fill, tmpfs

        with tmpfs(tmp / "out", size=size) as out:
            if full_at_start:
                (out / ".run.lock").write_text("0" * 16)
                fill(out)
            return _train_writing(tmp, out, train__steps=6, train__checkpoint_every=2)
    return run


def _file_size_limit(tmp: Path) -> CliResult:
    from megatron_packing.config.data_loading import load_data_split
    from megatron_packing.config.training import training_config_from_dict

    from .process_checks import file_size_limit

    cfg = training_config_from_dict(_training_doc(tmp))
    load_data_split(cfg.data, cfg.data.paths, resolve=cfg.resolve, build_sharers=1)
    return _train_writing(tmp, tmp / "out", file_size_limit(300_000),
                          train__checkpoint_every=2)


CASES += [
    Case("kill -9 of the launcher (2 loader workers)", "process lifetime",
         _kill("launcher", 2, "after a save"), check=lambda left: left == [], group="ranks"),
    Case("kill -9 of one rank", "process lifetime", _kill("one rank", 0, "after a save"),
         check=lambda left: left == [], group="ranks"),
    Case("kill -9 of the launcher's process group (2 loader workers)", "process lifetime",
         _kill("process group", 2, "after a save"), check=lambda left: left == [],
         group="ranks"),
    Case("kill -9 of the launcher during a save", "process lifetime",
         _kill("launcher", 0, "during a save"), check=lambda left: left == [], group="ranks"),
    Case("output directory on a read-only file system", "write faults", _read_only_output,
         "/out/.run.lock: [Errno ", group="cli"),
    Case("output directory under /sys (cannot be created)", "write faults",
         lambda tmp: _train_writing(tmp, Path("/sys") / f"megatron-packing-{tmp.name}"),
         "cannot write /sys/megatron-packing-", group="cli"),
    Case("file-size limit (ulimit -f) at the first checkpoint", "write faults",
         _file_size_limit, "[Errno 27] File too large; nothing was published", group="ranks"),
]


def _can_mount() -> bool:
    from .process_checks import can_mount

    return can_mount()


if _can_mount():  # a small tmpfs that fills (root only)
    CASES += [
        Case("disk full at the second checkpoint", "write faults", _small_disk("3500k"),
             "[Errno 28] No space left on device; nothing was published and the last "
             "complete checkpoint", group="ranks"),
        Case("disk already full when training starts", "write faults",
             _small_disk("256k", full_at_start=True),
             "/metrics.jsonl: [Errno 28] No space left on device", group="ranks"),
    ]


# ---------------------------------------------------------------------------- what is trained
def _targets_resume(change: str) -> Callable[[Path], Any]:
    """A loader state saved over the demo chats, loaded into a loader over the same chats read
    with ``change``: other loss masks, another template, weight fields, the YAML's B."""
    def run(tmp: Path) -> Any:
        import shutil

        from megatron_packing.config import PackingConfig
        from megatron_packing.data import load_sft_dataset
        from megatron_packing.loader.dataloader import build_sft_dataloader

        data = tmp / "train.jsonl"
        lines = DEMO_DATA.read_text().splitlines()[:30]
        data.write_text("\n".join(lines) + "\n")
        config = PackingConfig(global_batch_size=8, bin_capacity=2048,
                               align_packing_bins_to_dp=True, oversize_policy="truncate",
                               packing_batch_size_allowed_variation=0.25)

        def loader(path: Path, tokenizer: Path, cfg: Any = config, **options: Any) -> Any:
            ds = load_sft_dataset([str(path)], str(tokenizer), cache_dir=str(tmp / "cache"),
                                  show_progress=False, **options)
            return build_sft_dataloader(ds, cfg, dp_rank=0, dp_size=2, seed=3)

        saved = loader(data, TOKENIZER)
        next(iter(saved))
        state = saved.state_dict()
        tokenizer, path, cfg, options = TOKENIZER, data, config, {}
        if change == "loss_on":
            options = {"loss_on": "all"}
        elif change == "template":
            tokenizer = tmp / "tokenizer"
            shutil.copytree(TOKENIZER, tokenizer)
            template = (tokenizer / "chat_template.jinja").read_text()
            (tokenizer / "chat_template.jinja").write_text(template.replace(
                "'<|im_start|>' + message['role'] + '\\n'",
                "'<|im_start|>' + message['role'] + ':\\n'"))
        elif change == "weight":
            records = [json.loads(line) for line in lines]
            for message in records[1]["messages"]:
                if message["role"] == "assistant":
                    message["weight"] = 0
            records[1]["messages"] += [{"role": "user", "content": "more"},
                                       {"role": "assistant", "content": "yes"}]
            path = tmp / "weighted.jsonl"
            path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
        elif change == "batch":
            cfg = config.with_keys(global_batch_size=10)
        loader(path, tokenizer, cfg, **options).load_state_dict(state)
        return "loaded"
    return run


def _live_load(kind: str) -> Callable[[Path], Any]:
    """A state loaded while an iterator runs (its warning is the expected outcome)."""
    def run(tmp: Path) -> Any:
        from torch.utils.data import SequentialSampler

        from megatron_packing.config import PackingConfig
        from megatron_packing.loader.dataloader import build_sft_dataloader
        from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler

        if kind == "sampler":
            sampler = DPAlignedPackingBatchSampler(SequentialSampler(range(40)),
                                                   [50 + i for i in range(40)], 8, 2,
                                                   bin_capacity=512, allowed_variation=0.25)
            state = sampler.state_dict()
            steps = iter(sampler)
            next(steps)
            sampler.load_state_dict(state)
            return "loaded"
        dataset = _Duck([_ex(20 + 7 * i) for i in range(40)])
        config = PackingConfig(global_batch_size=8, bin_capacity=512,
                               align_packing_bins_to_dp=True,
                               packing_batch_size_allowed_variation=0.25)
        loader = build_sft_dataloader(dataset, config, dp_rank=0, dp_size=2,
                                      num_workers=2 if kind == "workers" else 0)
        state = loader.state_dict()
        running = iter(loader)
        next(running)
        if kind == "global":
            loader.load_stream_state(loader.stream_state(state))
        else:
            loader.load_state_dict(state)
        del running
        return "loaded"
    return run


def _pad_token(tmp: Path) -> Any:
    from megatron_packing.config import PackingConfig

    PackingConfig(pad_token_id=3000).check_token_ids(2815, source="sft.yaml")


def _packing_file(tmp: Path, packing: str, extra: str = "") -> Path:
    return _yaml(tmp, f"packing:\n{packing}data:\n  paths: [{DEMO_DATA}]\n"
                      f"  tokenizer: {TOKENIZER}\n{extra}", "sft.yaml")


def _entry_reads(tmp: Path) -> Any:
    from megatron_packing.config.sections import read_sections

    return read_sections(_packing_file(tmp, "  seed: 3\n", "train:\n  steps: 4\n"),
                         command="the Megatron-LM entry point", reads=("packing", "data"))


def _output_file(command: list[str]) -> Callable[[Path], Any]:
    def prepare(tmp: Path) -> list[str]:
        (tmp / "taken").write_text("a file")
        return ["--output-dir", str(tmp / "taken")]
    return _cli(command, prepare=prepare)


def _with_packing_file(packing: str, command: list[str],
                       expect_ok: bool = False) -> Callable[[Path], Any]:
    """``command`` on a packing YAML; ``expect_ok``: it runs, and says the fragment."""
    def run(tmp: Path) -> Any:
        path = _packing_file(tmp, packing)
        dp = ["--dp-size", "2"] if command[0] == "simulate" else []
        return _cli([*command, "--config", str(path), *dp], expect_ok=expect_ok)(tmp)
    return run


CASES += [
    Case("resume with loss_on all instead of the assistant turns", "fingerprint of targets",
         _targets_resume("loss_on"), "data.loss_on: saved 'assistant', now 'all'"),
    Case("resume with another chat template", "fingerprint of targets",
         _targets_resume("template"), "data.tokenizer (its vocabulary, special tokens and chat"),
    Case("resume with a weight field set to 0", "fingerprint of targets",
         _targets_resume("weight"), "cannot resume"),
    Case("resume with another global_batch_size (named by its key)", "fingerprint of targets",
         _targets_resume("batch"), "global_batch_size: saved 8, now 10"),
    Case("load_state_dict under a live loader iterator", "live state", _live_load("loader"),
         "applies from the next iter(loader)"),
    Case("load_state_dict under a live loader iterator (2 workers)", "live state",
         _live_load("workers"), "applies from the next iter(loader)"),
    Case("load_stream_state under a live loader iterator", "live state", _live_load("global"),
         "load_stream_state while an iterator is running"),
    Case("load_state_dict under a live sampler iterator", "live state", _live_load("sampler"),
         "applies from the next iter(sampler)"),
    Case("pad_token_id beyond the vocabulary", "paths and token ids", _pad_token,
         "packing.pad_token_id 3000 is not in the vocabulary"),
    Case("simulate --output-dir naming a file", "paths and token ids",
         _output_file(["simulate", "--config", str(REPO / "configs" / "demo_cpu.yaml")]),
         "--output-dir", group="cli"),
    Case("tune --output-dir naming a file", "paths and token ids",
         _output_file(["tune", "--config", str(REPO / "configs" / "demo_cpu.yaml")]),
         "is a file, not a directory", group="cli"),
    Case("calibrate --output-dir naming a file", "paths and token ids",
         _output_file(["calibrate", "--from-timings", "t.jsonl"]),
         "is a file, not a directory", group="cli"),
    Case("the trainer's sections under the Megatron-LM entry point", "one reader",
         _entry_reads, "the section train has no effect on the Megatron-LM entry point"),
    Case("a padded-only key in packed mode, by simulate", "one reader",
         _with_packing_file("  max_tokens_per_microbatch: 4096\n", ["simulate"]),
         "max_tokens_per_microbatch is only read in padded mode", group="cli"),
    Case("a padded-only key in packed mode, by prepare", "one reader",
         _with_packing_file("  max_tokens_per_microbatch: 4096\n", ["prepare"]),
         "max_tokens_per_microbatch is only read in padded mode", group="cli"),
    Case("a packing key in padded mode, by inspect", "one reader",
         _with_packing_file("  use_sequence_packing: false\n  pad_bins_to_capacity: true\n",
                            ["inspect"], expect_ok=True),
         "pad_bins_to_capacity has no effect in padded mode", group="cli"),
]
