"""The keyword forms of the sampler, the collator and the loader's workers, typed for mypy.

``DPAlignedPackingBatchSampler(sampler, lengths, 64, 8, bin_capacity=4096,
allowed_variation=0.1)`` builds its `PackedSamplerConfig` from these keywords. Each TypedDict
names exactly the flat fields of its config (`config_from_keywords` sends each keyword to the
field of its name), with the field's type; the defaults are the config dataclasses' own, never
written here. `tests/config/test_keywords.py` fails when a TypedDict and its config drift apart.
"""

from __future__ import annotations

from typing import Any, TypedDict


class PackerKeywords(TypedDict, total=False):
    """`PackerConfig`'s fields."""

    bin_capacity: int
    algorithm: str
    oversize_policy: str
    tp_size: int
    cp_size: int
    fp8_enabled: bool
    fp8_recipe: str | None
    pad_bins_to_capacity: bool


class PackedSamplerKeywords(PackerKeywords, total=False):
    """`PackedSamplerConfig`'s flat fields but B and dp, which the sampler takes by position:
    the packer's, the planner's and its own."""

    allowed_variation: float
    align_to_dp: bool
    lookahead_steps: int
    max_packs: int | None
    max_deferred_examples: int
    rank_assignment: str
    attention_cost_constant: float
    microbatch_cost_tokens: float
    seed: int
    eval_mode: bool


class CollatorKeywords(TypedDict, total=False):
    """`CollatorConfig`'s fields."""

    pad_token_id: int


class WorkerKeywords(TypedDict, total=False):
    """`WorkerConfig`'s fields."""

    num_workers: int
    persistent_workers: bool
    prefetch_factor: int | None
    pin_memory: bool
    multiprocessing_context: Any


__all__ = ["POSITIONAL_SAMPLER_FIELDS", "CollatorKeywords", "PackedSamplerKeywords", "PackerKeywords", "WorkerKeywords"]

POSITIONAL_SAMPLER_FIELDS = ("batch_size", "dp_size")
"""`PackedSamplerConfig` fields the sampler takes as its own parameters, not as keywords."""
