"""The typed keyword forms name exactly their configs' fields, with the fields' own types."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from megatron_packing.config.components import (
    CollatorConfig,
    PackedSamplerConfig,
    PackerConfig,
    PlannerConfig,
    WorkerConfig,
    keyword_names,
)
from megatron_packing.config.keywords import (
    POSITIONAL_SAMPLER_FIELDS,
    CollatorKeywords,
    PackedSamplerKeywords,
    WorkerKeywords,
)


def field_types(*classes: type) -> dict[str, object]:
    types: dict[str, object] = {}
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not dataclasses.is_dataclass(hints[f.name]):
                types[f.name] = hints[f.name]
    return types


def drift(keywords: type, config: type, *flat: type, positional: tuple[str, ...] = ()) -> list[str]:
    """Where a keyword TypedDict and the config it builds disagree (names or types)."""
    expected = {name: kind for name, kind in field_types(*flat).items() if name not in positional}
    assert set(keyword_names(config)) - set(positional) == set(expected)
    given = typing.get_type_hints(keywords)
    problems = [f"{name}: missing" for name in expected if name not in given]
    problems += [f"{name}: not a field" for name in given if name not in expected]
    problems += [f"{name}: {given[name]} != {kind}" for name, kind in expected.items()
                 if name in given and given[name] != kind]
    return problems


@pytest.mark.parametrize("keywords, config, flat, positional", [
    (PackedSamplerKeywords, PackedSamplerConfig, (PackerConfig, PlannerConfig, PackedSamplerConfig),
     POSITIONAL_SAMPLER_FIELDS),
    (CollatorKeywords, CollatorConfig, (CollatorConfig,), ()),
    (WorkerKeywords, WorkerConfig, (WorkerConfig,), ()),
], ids=["sampler", "collator", "workers"])
def test_each_keyword_form_is_its_configs_fields(keywords, config, flat, positional):
    assert drift(keywords, config, *flat, positional=positional) == []


def test_the_check_sees_a_missing_a_stray_and_a_mistyped_keyword():
    class Drifted(typing.TypedDict, total=False):
        pad_token_id: str  # CollatorConfig says int
        pad_to: bool  # not a field
    assert sorted(drift(Drifted, CollatorConfig, CollatorConfig)) == [
        "pad_to: not a field", "pad_token_id: <class 'str'> != <class 'int'>"]
