"""The training YAML's non-packing sections as declarative dataclasses, checked on load.

A training YAML has five sections: ``packing`` (`megatron_packing.config.PackingConfig`),
``data``, ``model``, ``train`` and ``logging``. Unknown keys are errors, with a suggestion.
Every value is checked here, in the launcher, so a bad one fails at once and never after
the ranks have started.

One seed decides the example order: ``packing.seed``. ``model.init_seed`` decides the initial
weights. (``train.seed`` no longer exists; a YAML that still sets it is refused by name.)
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_packing.common.config_fields import MAX_SEED
from megatron_packing.common.validation import (
    require_bool,
    require_choice,
    require_int,
    require_number,
)
from megatron_packing.config import (
    ConfigError,
    PackingConfig,
    dataclass_from_mapping,
    read_yaml_mapping,
)

WANDB_MODES = ("offline", "online", "disabled")
DTYPES = ("float32", "float64")
BACKENDS = ("megatron_ddp", "fsdp2")
"""``train.backend``: ``megatron_ddp`` replicates the model and SUMs gradients over DP in
megatron-core's schedule; ``fsdp2`` shards it with torch's ``fully_shard`` (`megatron.fsdp2`)."""


@dataclass
class ModelConfig:
    """A small megatron-core GPTModel (learned absolute positions; CPU friendly)."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None  # None: 4 x hidden_size
    max_position_embeddings: int | None = None  # None: the packing bin capacity
    dtype: str = "float32"  # float32 or float64
    init_seed: int = 1234


@dataclass
class TrainConfig:
    steps: int = 60
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 5
    weight_decay: float = 0.0
    clip_grad: float = 1.0  # 0: no clipping
    dp_size: int = 2
    checkpoint_every: int = 20
    checkpoint_keep: int = 3  # complete checkpoints kept; older ones are deleted
    log_every: int = 5
    eval_every: int = 0  # validate on data.valid_paths every N steps (0: after training only)
    num_workers: int = 0
    output_dir: str = "runs/demo_cpu"
    backend: str = "megatron_ddp"  # one of BACKENDS


@dataclass
class DataConfig:
    paths: list[str] = field(default_factory=list)
    tokenizer: str = ""
    loss_on: str = "assistant"
    on_bad_record: str = "error"
    cache_dir: str | None = None
    valid_paths: list[str] = field(default_factory=list)  # validation data (empty: none)


@dataclass
class LoggingConfig:
    wandb: bool = True
    wandb_project: str = "megatron-packing"
    wandb_mode: str = "offline"  # offline, online or disabled; WANDB_MODE overrides
    run_name: str | None = None
    jsonl: bool = True
    plot: bool = True


@dataclass
class TrainingConfig:
    packing: PackingConfig
    model: ModelConfig
    train: TrainConfig
    data: DataConfig
    logging: LoggingConfig
    base_dir: str = "."  # relative data and tokenizer paths resolve against this

    def resolve(self, path: str) -> str:
        """A path from the config, made absolute against the config's base directory."""
        p = Path(path)
        return str(p if p.is_absolute() else Path(self.base_dir) / p)

    def to_dict(self) -> dict[str, Any]:
        """Every section as plain values; the packing section by its flat YAML keys."""
        return {**dataclasses.asdict(self), "packing": self.packing.to_dict()}


_SECTIONS = {"model": ModelConfig, "train": TrainConfig, "data": DataConfig, "logging": LoggingConfig}
TRAINER_SECTIONS = ("model", "train", "logging")
"""The sections only the demo trainer reads (the Megatron-LM entry point takes its arguments)."""


class _Checker:
    """Checks a section's values with the shared checks, naming the file and the full key."""

    def __init__(self, source: str, section: str, values: Any) -> None:
        self.source, self.section, self.values = source, section, values

    def _name(self, key: str) -> str:
        return f"{self.source}: {self.section}.{key}"

    def fail(self, key: str, expected: str) -> None:
        value = getattr(self.values, key)
        raise ConfigError(f"{self._name(key)} must be {expected}, got {value!r}")

    def integer(self, key: str, minimum: int, *, optional: bool = False,
                maximum: int | None = None) -> None:
        require_int(self._name(key), getattr(self.values, key), minimum=minimum,
                    maximum=maximum, allow_none=optional)

    def number(self, key: str, *, minimum: float, strict: bool) -> None:
        require_number(self._name(key), getattr(self.values, key), minimum=minimum,
                       exclusive=strict)

    def choice(self, key: str, choices: tuple[str, ...]) -> None:
        require_choice(self._name(key), getattr(self.values, key), choices)

    def boolean(self, key: str) -> None:
        require_bool(self._name(key), getattr(self.values, key))

    def text(self, key: str, *, optional: bool = False) -> None:
        value = getattr(self.values, key)
        if (optional and value is None) or (isinstance(value, str) and value):
            return
        self.fail(key, "a non-empty string" + (" or null" if optional else ""))


def _check_train(t: TrainConfig, source: str) -> None:
    c = _Checker(source, "train", t)
    for key in ("steps", "dp_size", "checkpoint_every", "checkpoint_keep", "log_every"):
        c.integer(key, 1)
    c.integer("warmup_steps", 0)
    c.integer("eval_every", 0)
    c.integer("num_workers", 0)
    c.number("lr", minimum=0, strict=True)
    c.number("min_lr", minimum=0, strict=False)
    c.number("weight_decay", minimum=0, strict=False)
    c.number("clip_grad", minimum=0, strict=False)
    if t.min_lr > t.lr:
        c.fail("min_lr", f"<= train.lr ({t.lr})")
    c.text("output_dir")
    c.choice("backend", BACKENDS)


def _check_model(m: ModelConfig, packing: PackingConfig, source: str) -> None:
    c = _Checker(source, "model", m)
    for key in ("num_layers", "hidden_size", "num_attention_heads"):
        c.integer(key, 1)
    c.integer("ffn_hidden_size", 1, optional=True)
    # Packed rows hold bin_capacity positions; padded blocks the longest example (see launch).
    c.integer("max_position_embeddings", packing.bin_capacity if packing.use_sequence_packing
              else 1, optional=True)
    c.integer("init_seed", 0)
    if m.init_seed > MAX_SEED:
        c.fail("init_seed", "at most 2**63 - 1 (torch seeds with a signed 64-bit integer)")
    c.choice("dtype", DTYPES)
    if m.hidden_size % m.num_attention_heads:
        c.fail("num_attention_heads", f"a divisor of model.hidden_size ({m.hidden_size})")
    positions = m.max_position_embeddings or packing.bin_capacity
    table = positions * m.hidden_size * (8 if m.dtype == "float64" else 4)
    if table > _memory_bytes() // 2:
        raise ConfigError(
            f"{source}: the position-embedding table alone would take {table / 2**30:.1f} GiB "
            f"({positions} positions x hidden_size {m.hidden_size}), more than half of this "
            f"machine's memory ({_memory_bytes() / 2**30:.1f} GiB); lower packing.bin_capacity "
            "(or model.max_position_embeddings)")


def _memory_bytes() -> int:
    """Physical memory of this machine (a large default where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 2**40


def check_data_section(d: DataConfig, source: str) -> None:
    from megatron_packing.data import LOSS_ON_CHOICES, ON_BAD_RECORD_CHOICES

    c = _Checker(source, "data", d)
    if (not isinstance(d.paths, list) or not d.paths
            or not all(isinstance(p, str) and p for p in d.paths)):
        c.fail("paths", "a non-empty list of dataset paths")
    c.text("tokenizer")
    c.choice("loss_on", LOSS_ON_CHOICES)
    c.choice("on_bad_record", ON_BAD_RECORD_CHOICES)
    c.text("cache_dir", optional=True)
    if (not isinstance(d.valid_paths, list)
            or not all(isinstance(p, str) and p for p in d.valid_paths)):
        c.fail("valid_paths", "a list of dataset paths (empty: no validation data)")


def _check_logging(lg: LoggingConfig, source: str) -> None:
    c = _Checker(source, "logging", lg)
    for key in ("wandb", "jsonl", "plot"):
        c.boolean(key)
    c.choice("wandb_mode", WANDB_MODES)
    c.text("wandb_project")
    c.text("run_name", optional=True)


def _check_demo_packing(packing: PackingConfig, source: str) -> None:
    """What the demo trainer cannot run although the packing library accepts it."""
    if packing.use_sequence_packing and packing.oversize_policy == "own_bin":
        raise ConfigError(
            f"{source}: packing.oversize_policy 'own_bin' is not supported by the demo trainer: "
            f"its model and collator have bin_capacity ({packing.bin_capacity}) positions, and an "
            "own_bin row is longer; use 'truncate' or 'error', or raise packing.bin_capacity")


def check_paths_exist(cfg: TrainingConfig, source: str = "config") -> None:
    """The dataset files and the tokenizer directory named by the config exist."""
    for i, path in enumerate(cfg.data.paths):
        if not Path(cfg.resolve(path)).exists():
            raise ConfigError(f"{source}: data.paths[{i}] {cfg.resolve(path)!r} does not exist")
    for i, path in enumerate(cfg.data.valid_paths):
        if not Path(cfg.resolve(path)).exists():
            raise ConfigError(f"{source}: data.valid_paths[{i}] {cfg.resolve(path)!r} does not "
                              "exist")
    if not Path(cfg.resolve(cfg.data.tokenizer)).is_dir():
        raise ConfigError(f"{source}: data.tokenizer {cfg.resolve(cfg.data.tokenizer)!r} is not "
                          "a tokenizer directory")


def _section(cls: type, values: Any, name: str, source: str) -> Any:
    if values is None:
        return cls()
    return dataclass_from_mapping(cls, values, source=source, what=f"{name} key")


def training_config_from_dict(document: dict[str, Any], *, source: str = "config",
                              base_dir: str = ".") -> TrainingConfig:
    """Build and validate a `TrainingConfig` from a parsed YAML document."""
    if not isinstance(document, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level, "
                          f"got {type(document).__name__}")
    unknown = set(document) - {"packing", *_SECTIONS}
    if unknown:
        raise ConfigError(f"{source}: unknown sections {sorted(unknown)}; "
                          f"expected packing, {', '.join(_SECTIONS)}")
    parts = {name: _section(cls, document.get(name), name, source) for name, cls in _SECTIONS.items()}
    train: TrainConfig = parts["train"]
    _check_train(train, source)
    packing = PackingConfig.from_dict(document.get("packing") or {}, source=source)
    packing.validate(dp_size=train.dp_size)
    _check_demo_packing(packing, source)
    _check_model(parts["model"], packing, source)
    check_data_section(parts["data"], source)
    _check_logging(parts["logging"], source)
    return TrainingConfig(packing=packing, base_dir=base_dir, **parts)


def load_training_config(path: str | Path, *, check_paths: bool = True) -> TrainingConfig:
    """Read and check a training YAML; relative paths inside it resolve against the cwd."""
    document = read_yaml_mapping(path)
    if not document:
        raise ConfigError(f"{path}: the file is empty; expected the sections packing, "
                          f"{', '.join(_SECTIONS)}")
    cfg = training_config_from_dict(document, source=str(path), base_dir=".")
    if check_paths:
        check_paths_exist(cfg, str(path))
    return cfg
