"""Every YAML key of the schema is a statically declared, typed attribute of `PackingConfig`."""

from __future__ import annotations

import ast
import inspect
import typing
from types import SimpleNamespace

from megatron_packing.config.components import COMPONENTS, YAML_KEYS
from megatron_packing.config.key_attributes import YamlKeyAttributes
from megatron_packing.config.packing_config import PackingConfig


def declared_properties(cls: type) -> set[str]:
    """Names defined with ``@property`` in the class body of ``cls``, read from its source."""
    body = ast.parse(inspect.getsource(cls)).body[0].body  # type: ignore[attr-defined]
    return {node.name for node in body if isinstance(node, ast.FunctionDef)
            and any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)}


def test_each_yaml_key_has_a_declared_property_and_each_property_is_a_key():
    declared = declared_properties(YamlKeyAttributes)
    assert sorted(set(YAML_KEYS) - declared) == [], "YAML keys without a declared attribute"
    assert sorted(declared - set(YAML_KEYS)) == [], "declared attributes that are no YAML key"
    assert all(isinstance(inspect.getattr_static(PackingConfig, key), property) for key in YAML_KEYS)


def test_each_property_reads_the_field_its_key_maps_to_with_that_fields_type():
    # Every field a distinct marker: a property reading another field (or component) shows.
    components = SimpleNamespace(**{
        name: SimpleNamespace(**{field: (name, field) for key, (part, field) in YAML_KEYS.items()
                                 if part == name})
        for name in COMPONENTS})
    for key, (component, field) in YAML_KEYS.items():
        reader = inspect.getattr_static(YamlKeyAttributes, key).fget
        assert reader(components) == (component, field), key
        declared = typing.get_type_hints(reader)["return"]
        assert declared == typing.get_type_hints(COMPONENTS[component])[field], key


def test_the_attributes_are_the_configs_values():
    config = PackingConfig(global_batch_size=64, bin_capacity=2048, tp_size=2, seed=7,
                           max_tokens_per_microbatch=4096, fp8_enabled=True, fp8_recipe="mxfp8")
    assert {key: getattr(config, key) for key in YAML_KEYS} == config.to_dict()
    assert (config.global_batch_size, config.tp_size, config.fp8_recipe) == (64, 2, "mxfp8")
    assert config.max_tokens_per_microbatch == 4096 and config.seed == 7
