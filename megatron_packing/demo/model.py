"""A tiny megatron-core GPTModel for CPU runs, and the forward pass of one micro-batch.

A micro-batch is a packed row (`PackedMicroBatch`, [1, T]) or a padded block
(`PaddedMicroBatch`, [b, L], right-padded).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_packing.config.training import ModelConfig
from megatron_packing.megatron.packed_seq import (
    block_diagonal_causal_mask,
    packed_seq_params,
)
from megatron_packing.packed.collate import PackedMicroBatch
from megatron_packing.padded.collate import PaddedMicroBatch

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


def padded_causal_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[b, 1, L, L] bool, True where attention is forbidden (megatron-core's convention).

    Row i holds ``lengths[i]`` real tokens then padding: query t may attend key s only if
    s <= t and s is a real token, so padding never reaches a real token. A padding query also
    sees itself (its output has zero loss), so no softmax row is empty, even in an empty row.
    """
    keys = torch.arange(width)
    causal = keys[None, :] <= keys[:, None]  # [L, L]: key s <= query t
    real_key = keys[None, :] < lengths.to(torch.int64)[:, None]  # [b, L]
    allowed = causal[None] & real_key[:, None, :]
    allowed |= torch.eye(width, dtype=torch.bool)[None]
    return (~allowed)[:, None]


def per_token_loss(model: torch.nn.Module, mb: PackedMicroBatch | PaddedMicroBatch, *,
                   thd: bool = False, loss_from_logits: bool = False) -> torch.Tensor:
    """[b, T] cross-entropy of every position of one micro-batch (mask not applied).

    A packed row (b = 1) gets its block-diagonal mask and restarting positions; a padded block
    gets each row's own positions 0..L-1 and `padded_causal_mask`.

    ``thd=True`` (GPUs with Transformer Engine attention) passes a THD `PackedSeqParams`;
    otherwise a block-diagonal causal mask separates the sequences (the CPU path). With
    ``loss_from_logits`` the cross-entropy is computed here in the logits' dtype (megatron's
    vocab-parallel cross-entropy works in float32), which float64 equivalence checks need.
    """
    device = next(model.parameters()).device
    tokens = mb.tokens.to(device)
    labels = mb.labels.to(device)
    positions = mb.position_ids.to(device)
    rows, total_len = tokens.shape
    if isinstance(mb, PaddedMicroBatch):
        if thd:
            raise ValueError("a padded micro-batch has no THD layout: run it with thd=False")
        mask = padded_causal_mask(mb.lengths, total_len).to(device)
        params = None
    elif thd:
        mask = None
        params = packed_seq_params(mb, device)
    else:
        mask = block_diagonal_causal_mask(mb.cu_seqlens_padded, total_len).to(device)
        params = None
    if not loss_from_logits:
        return model(tokens, positions, mask, labels=labels, packed_seq_params=params)
    logits = model(tokens, positions, mask, packed_seq_params=params)  # [b, T, V]
    return F.cross_entropy(logits.reshape(rows * total_len, -1), labels.reshape(-1),
                           reduction="none").reshape(rows, total_len)
