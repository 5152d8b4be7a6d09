"""The one reader of a training YAML for every command, so a key is accepted, warned about or
refused the same way whichever command reads the file.

Two kinds of file: a demo-trainer YAML (with any of ``model``, ``train``, ``logging``) is checked
whole, as ``megatron-packing train`` checks it (`training.training_config_from_dict`); a
packing YAML (``packing`` and ``data`` only, what the Megatron-LM entry point takes) has its
``packing:`` keys checked by name and by the mode that reads them (`mode_keys`; their values are
judged once the command completes them: the Megatron-LM entry point from Megatron's arguments)
and its ``data:`` section checked as ``train`` checks it. A section the command does not read
(the trainer's sections under the Megatron-LM entry point, whose arguments set those things) is
warned about once, by name: nothing in the file is accepted and then ignored in silence.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_packing.common.validation import ConfigError
from megatron_packing.config.components import YAML_KEYS
from megatron_packing.config.mode_keys import UnusedKeyWarning, check_mode_keys
from megatron_packing.config.packing_config import PackingConfig
from megatron_packing.config.training import (
    TRAINER_SECTIONS,
    DataConfig,
    TrainingConfig,
    check_data_section,
    training_config_from_dict,
)
from megatron_packing.config.yaml_io import check_mapping, dataclass_from_mapping, read_yaml_mapping

SECTIONS = ("packing", "data", *TRAINER_SECTIONS)
_DEFAULT_KEYS = PackingConfig().to_dict()


@dataclass
class YamlSections:
    """A training YAML as every command reads it."""

    source: str
    document: dict[str, Any]  # the file as parsed
    packing_values: dict[str, Any]  # the packing: section as written (names checked)
    data: DataConfig
    training: TrainingConfig | None  # the whole file, checked as `train` does (trainer YAMLs)


def read_sections(path: str | Path, *, command: str, reads: tuple[str, ...] = SECTIONS
                  ) -> YamlSections:
    """Read ``path`` for ``command``, which reads the sections ``reads`` (see the module)."""
    source = str(path)
    document = read_yaml_mapping(path)
    if not document:
        raise ConfigError(f"{source}: the file is empty; expected the sections packing and data"
                          f" (and, for megatron-packing train, {', '.join(TRAINER_SECTIONS)})")
    unknown = sorted(set(document) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"{source}: unknown sections {unknown}; expected "
                          f"{', '.join(SECTIONS)}")
    unread = [name for name in TRAINER_SECTIONS if name in document and name not in reads]
    if unread:
        warnings.warn(
            f"{source}: the section{'s' if len(unread) > 1 else ''} {', '.join(unread)} "
            f"{'have' if len(unread) > 1 else 'has'} no effect on {command}, which takes what "
            "they set from its own arguments; remove them, or keep them for "
            "megatron-packing train", UnusedKeyWarning, stacklevel=2)
    packing_values = document.get("packing") or {}
    if not isinstance(packing_values, dict):
        raise ConfigError(f"{source}: packing must be a mapping of packing keys, got "
                          f"{type(packing_values).__name__}")
    training = None
    if any(name in document for name in TRAINER_SECTIONS) and not unread:
        training = training_config_from_dict(document, source=source)
        data = training.data
    else:
        check_mapping(packing_values, YAML_KEYS, source=source, what="packing key")
        packing_mode = packing_values.get("use_sequence_packing", True)
        check_mode_keys(packing_values, _DEFAULT_KEYS, packing_mode is not False, source=source)
        data = dataclass_from_mapping(DataConfig, document.get("data") or {}, source=source,
                                      what="data key")
        check_data_section(data, source)
    return YamlSections(source, document, dict(packing_values), data, training)


__all__ = ["SECTIONS", "YamlSections", "read_sections"]
