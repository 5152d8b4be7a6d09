"""The GPT model the Megatron-LM entry point trains: Megatron-LM's builder, or the library's.

Two providers build it from Megatron's parsed arguments:

* ``megatron-lm``: a Megatron-LM checkout's ``model_provider.model_provider`` with
  ``gpt_builders.gpt_builder`` (what ``pretrain_gpt.py`` uses), imported from ``PYTHONPATH``;
* ``project``: `gpt_model_provider`, which builds megatron-core's ``GPTModel`` from
  ``megatron.training.arguments.core_transformer_config_from_args`` and megatron-core's own
  GPT layer specs (Transformer Engine or local layers, dense or MoE). With megatron-core 0.19,
  whose wheel ships ``megatron.training``, it needs no checkout at all.

``--packing-model-provider auto`` (the default) takes the checkout's when both of its modules
are importable, else the library's. Arguments only Megatron-LM's builder reads (``--spec``,
``--yaml-cfg``, heterogeneous layers, experimental attention variants, kitchen quantisation)
are refused with the library's provider, naming the provider that honours them.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from functools import partial
from typing import Any

PROVIDERS = ("auto", "megatron-lm", "project")
CHECKOUT_MODULES = ("model_provider", "gpt_builders")

# Megatron-LM arguments that only its gpt_builder reads: (dest, flag, why it matters).
_BUILDER_ONLY = (
    ("spec", "--spec", "a custom layer spec module"),
    ("yaml_cfg", "--yaml-cfg", "the model config from a YAML file"),
    ("heterogeneous_layers_config_path", "--heterogeneous-layers-config-path",
     "heterogeneous layers"),
    ("experimental_attention_variant", "--experimental-attention-variant",
     "an experimental attention variant"),
    ("use_kitchen", "--use-kitchen", "kitchen quantisation"),
)


def checkout_importable() -> bool:
    """Whether a Megatron-LM checkout's ``model_provider`` and ``gpt_builders`` can be imported."""
    return all(importlib.util.find_spec(name) is not None for name in CHECKOUT_MODULES)


def chosen_provider(requested: str) -> str:
    """``megatron-lm`` or ``project`` for ``--packing-model-provider requested``."""
    if requested not in PROVIDERS:
        raise ValueError(f"--packing-model-provider {requested!r}: use one of "
                         f"{', '.join(PROVIDERS)}")
    if requested == "auto":
        return "megatron-lm" if checkout_importable() else "project"
    return requested


def provider_refusals(args: Any, provider: str) -> list[str]:
    """Start-up refusals for ``provider`` (``megatron-lm`` or ``project``) with ``args``."""
    if provider == "megatron-lm":
        missing = [name for name in CHECKOUT_MODULES if importlib.util.find_spec(name) is None]
        if missing:
            return [f"--packing-model-provider megatron-lm: {' and '.join(missing)} not "
                    "importable; put a Megatron-LM checkout (the folder holding "
                    "model_provider.py and gpt_builders.py) on PYTHONPATH, or use "
                    "--packing-model-provider project"]
        return []
    return [f"{flag}: {why} is read only by Megatron-LM's gpt_builder, not by the library's GPT "
            "provider; put a Megatron-LM checkout on PYTHONPATH and pass "
            "--packing-model-provider megatron-lm, or remove the argument"
            for dest, flag, why in _BUILDER_ONLY if getattr(args, dest, None)]


def model_provider_for(provider: str) -> Callable[..., Any]:
    """The ``model_provider_func`` Megatron's ``setup_model_and_optimizer`` is given."""
    if provider == "megatron-lm":
        from gpt_builders import gpt_builder
        from model_provider import model_provider

        return partial(model_provider, gpt_builder)
    return gpt_model_provider


def gpt_model_provider(pre_process: bool = True, post_process: bool = True,
                       vp_stage: int | None = None, config: Any = None,
                       pg_collection: Any = None) -> Any:
    """megatron-core's ``GPTModel`` from Megatron's parsed arguments (``get_args()``).

    The signature is the one Megatron's ``get_model`` calls. The transformer config comes from
    ``core_transformer_config_from_args`` unless ``config`` is given.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.training import get_args, print_rank_0
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    print_rank_0("building GPT model (megatron_packing's provider) ...")
    if config is None:
        config = core_transformer_config_from_args(args)
    return GPTModel(
        config=config,
        transformer_layer_spec=gpt_layer_spec(args, config, vp_stage),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )


def gpt_layer_spec(args: Any, config: Any, vp_stage: int | None) -> Any:
    """megatron-core's layer spec for ``args``: a decoder block spec for MoE (its layers may
    differ), else one layer spec; Transformer Engine layers with ``--transformer-impl
    transformer_engine``, megatron-core's local layers otherwise."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    use_te = args.transformer_impl == "transformer_engine"
    if args.num_experts:
        return specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                                normalization=args.normalization,
                                                qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)
    common = {"qk_layernorm": args.qk_layernorm,
              "multi_latent_attention": args.multi_latent_attention,
              "qk_l2_norm": args.qk_l2_norm}
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(**common)
    return specs.get_gpt_layer_local_spec(normalization=args.normalization, **common)
