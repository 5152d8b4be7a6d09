"""The dataloader's configuration: validated components, and the YAML keys that set them.

`components` holds one frozen dataclass per component and the `YAML_KEYS` table;
`packing_config` holds `PackingConfig`, which composes them, and `load_config`; `yaml_io` reads
the files; `training` the training YAML's other sections.
"""

from megatron_packing.common.validation import (
    ConfigError,
    allowed_batch_variation,
    check_batch_window,
)
from megatron_packing.config.components import (
    BASE_ORDERS,
    COMPONENTS,
    SAMPLER_SPLIT_METHOD,
    YAML_KEYS,
    CollatorConfig,
    LoaderConfig,
    PackerConfig,
    PaddedConfig,
    PlannerConfig,
    YamlKey,
)
from megatron_packing.config.packing_config import PackingConfig, load_config
from megatron_packing.config.yaml_io import dataclass_from_mapping, read_yaml_mapping

__all__ = [
    "BASE_ORDERS",
    "COMPONENTS",
    "SAMPLER_SPLIT_METHOD",
    "YAML_KEYS",
    "YamlKey",
    "CollatorConfig",
    "ConfigError",
    "LoaderConfig",
    "PackerConfig",
    "PackingConfig",
    "PaddedConfig",
    "PlannerConfig",
    "allowed_batch_variation",
    "check_batch_window",
    "dataclass_from_mapping",
    "load_config",
    "read_yaml_mapping",
]
