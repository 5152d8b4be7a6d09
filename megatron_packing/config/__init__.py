"""The dataloader's configuration: validated components, and the YAML keys that set them.

`components` holds one frozen dataclass per component (and what the samplers take);
`packing_config` holds `PackingConfig`, which composes them, and `load_config`; `yaml_io` reads
the files.
"""

from megatron_packing.common.validation import (
    ConfigError,
    allowed_batch_variation,
    check_batch_window,
)
from megatron_packing.config.components import (
    BASE_ORDERS,
    COMPONENTS,
    OVERSIZE_POLICIES,
    PACKING_ALGORITHMS,
    RANK_ASSIGNMENTS,
    SAMPLER_SPLIT_METHOD,
    YAML_KEYS,
    CollatorConfig,
    LoaderConfig,
    PackedSamplerConfig,
    PackerConfig,
    PaddedConfig,
    PaddedSamplerConfig,
    PlannerConfig,
    WorkerConfig,
    config_from_keywords,
    config_or_keywords,
    keyword_names,
)
from megatron_packing.config.packing_config import PackingConfig, load_config
from megatron_packing.config.yaml_io import dataclass_from_mapping, read_yaml_mapping

__all__ = [
    "BASE_ORDERS",
    "COMPONENTS",
    "OVERSIZE_POLICIES",
    "PACKING_ALGORITHMS",
    "RANK_ASSIGNMENTS",
    "SAMPLER_SPLIT_METHOD",
    "YAML_KEYS",
    "CollatorConfig",
    "ConfigError",
    "LoaderConfig",
    "PackedSamplerConfig",
    "PackerConfig",
    "PackingConfig",
    "PaddedConfig",
    "PaddedSamplerConfig",
    "PlannerConfig",
    "WorkerConfig",
    "allowed_batch_variation",
    "check_batch_window",
    "config_from_keywords",
    "config_or_keywords",
    "dataclass_from_mapping",
    "keyword_names",
    "load_config",
    "read_yaml_mapping",
]
