"""A tiny megatron-core GPTModel for CPU runs, and the forward pass of one packed micro-batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_packing.megatron.packed_seq import (
    block_diagonal_causal_mask,
    packed_seq_params,
)
from megatron_packing.megatron.trainer_config import ModelConfig
from megatron_packing.packed.collate import PackedMicroBatch

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def build_tiny_gpt(cfg: ModelConfig, *, vocab_size: int, max_seq_len: int) -> torch.nn.Module:
    """A GPTModel with the local (non-Transformer-Engine) layer spec, built on the CPU.

    Learned absolute position embeddings, because the rotary path ignores ``position_ids`` and
    restarting positions are what make a packed row equal to separate rows. Dropout is off so
    that runs are exactly reproducible. ``calculate_per_token_loss`` is on (see `loss`).
    Needs megatron parallel state initialised and `apply_cpu_workarounds` on CPU.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = _DTYPES[cfg.dtype]
    config = TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=cfg.ffn_hidden_size,
        use_cpu_initialization=True,
        params_dtype=dtype,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        calculate_per_token_loss=True,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
    )
    torch.manual_seed(cfg.init_seed)
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=vocab_size,
        max_sequence_length=cfg.max_position_embeddings or max_seq_len,
        position_embedding_type="learned_absolute",
    )
    # Some submodules (norms) ignore params_dtype; make every parameter the requested dtype.
    return model.to(dtype)


def per_token_loss(model: torch.nn.Module, mb: PackedMicroBatch, *, thd: bool = False,
                   loss_from_logits: bool = False) -> torch.Tensor:
    """[1, T] cross-entropy of every position of one packed row (mask not applied).

    ``thd=True`` (GPUs with Transformer Engine attention) passes a THD `PackedSeqParams`;
    otherwise a block-diagonal causal mask separates the sequences (the CPU path). With
    ``loss_from_logits`` the cross-entropy is computed here in the logits' dtype (megatron's
    vocab-parallel cross-entropy works in float32), which float64 equivalence checks need.
    """
    device = next(model.parameters()).device
    tokens = mb.tokens.to(device)
    labels = mb.labels.to(device)
    positions = mb.position_ids.to(device)
    total_len = tokens.shape[1]
    if thd:
        mask = None
        params = packed_seq_params(mb, device)
    else:
        mask = block_diagonal_causal_mask(mb.cu_seqlens_padded, total_len).to(device)
        params = None
    if not loss_from_logits:
        return model(tokens, positions, mask, labels=labels, packed_seq_params=params)
    logits = model(tokens, positions, mask, packed_seq_params=params)  # [1, T, V]
    return F.cross_entropy(logits.reshape(total_len, -1), labels.reshape(-1),
                           reduction="none").reshape(1, total_len)
