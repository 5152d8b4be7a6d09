"""The training YAML's non-packing sections as declarative dataclasses.

A training YAML has five sections: ``packing`` (`megatron_packing.config.PackingConfig`),
``data``, ``model``, ``train`` and ``logging``. Unknown keys are errors, with a suggestion.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_packing.config import ConfigError, PackingConfig, dataclass_from_mapping


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
    clip_grad: float = 1.0
    seed: int = 1234
    dp_size: int = 2
    checkpoint_every: int = 20
    log_every: int = 5
    num_workers: int = 0
    output_dir: str = "runs/demo_cpu"


@dataclass
class DataConfig:
    paths: list[str] = field(default_factory=list)
    tokenizer: str = ""
    loss_on: str = "assistant"
    on_bad_record: str = "error"
    cache_dir: str | None = None
    valid_paths: list[str] = field(default_factory=list)  # validation data (Megatron-LM entry)


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
        return dataclasses.asdict(self)


_SECTIONS = {"model": ModelConfig, "train": TrainConfig, "data": DataConfig, "logging": LoggingConfig}


def _section(cls: type, values: Any, name: str, source: str) -> Any:
    if values is None:
        return cls()
    return dataclass_from_mapping(cls, values, source=source, what=f"{name} key")


def training_config_from_dict(document: dict[str, Any], *, source: str = "config",
                              base_dir: str = ".") -> TrainingConfig:
    """Build and validate a `TrainingConfig` from a parsed YAML document."""
    unknown = set(document) - {"packing", *_SECTIONS}
    if unknown:
        raise ConfigError(f"{source}: unknown sections {sorted(unknown)}; "
                          f"expected packing, {', '.join(_SECTIONS)}")
    parts = {name: _section(cls, document.get(name), name, source) for name, cls in _SECTIONS.items()}
    train: TrainConfig = parts["train"]
    packing = PackingConfig.from_dict(document.get("packing") or {}, source=source)
    packing.validate(dp_size=train.dp_size)
    if train.steps < 1 or train.dp_size < 1:
        raise ConfigError(f"{source}: train.steps and train.dp_size must be >= 1")
    if parts["model"].dtype not in ("float32", "float64"):
        raise ConfigError(f"{source}: model.dtype must be float32 or float64")
    return TrainingConfig(packing=packing, base_dir=base_dir, **parts)


def load_training_config(path: str | Path) -> TrainingConfig:
    """Read a training YAML; relative paths inside it resolve against the current directory."""
    path = Path(path)
    try:
        document = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return training_config_from_dict(document, source=str(path), base_dir=".")
