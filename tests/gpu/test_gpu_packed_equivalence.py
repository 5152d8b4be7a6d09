"""Packed training equals unpacked training on the GPU: token losses and gradients.

One packed row of real examples (the library's loader over the demo chats, its first step's
fullest row) goes through a megatron-core GPT on CUDA twice: packed, and each example alone at
positions 0... Every real token's loss must agree, and the gradient of the row's summed loss
must equal the sum of the examples' gradients. Two ways of keeping packed sequences apart:

* the exact block-diagonal causal mask (`packed_seq.block_diagonal_causal_mask`) with
  megatron-core's local attention, in float32 with TF32 off (what the entry point runs on a GPU
  without Transformer Engine);
* THD with `PackedSeqParams` (`packed_seq.packed_seq_params`) and Transformer Engine's attention,
  in bf16 (TE's fused kernels take no float32), where Transformer Engine imports.

Each also checks that the comparison can fail: the same row under a plain causal mask (every
sequence sees the ones before it) must differ from the examples alone by far more than the
tolerance.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from gpu_runs import TIER, TOKENIZER, transformer_engine, write_chats

pytestmark = TIER

VOCAB, CAPACITY = 2815, 2048
# Initial weights wider than megatron-core's default (0.02): attention then depends on context
# enough that a leak across sequences moves the token losses far beyond the tolerances.
INIT_STD = 0.2


def fullest_row(work: Path):
    """The packed row with the most examples in the first step of the library's loader."""
    from megatron_packing import PackingConfig, build_sft_dataloader, load_sft_dataset

    data = write_chats(work, train=400, valid=0)
    dataset = load_sft_dataset([str(data / "train.jsonl")], str(TOKENIZER),
                               cache_dir=str(work / "cache"), show_progress=False)
    packing = PackingConfig(global_batch_size=32, bin_capacity=CAPACITY,
                            oversize_policy="truncate")
    batch = next(iter(build_sft_dataloader(dataset, packing, dp_rank=0, dp_size=1, seed=1)))
    return max(batch.micro_batches, key=lambda mb: len(mb.example_indices))


@pytest.fixture(scope="module")
def row(tmp_path_factory):
    found = fullest_row(tmp_path_factory.mktemp("packed_row"))
    assert len(found.example_indices) >= 3, "the row must hold several examples"
    return found


@dataclass
class Pass:
    """Per-token losses of the real tokens of each sequence, and the gradient of their sum."""

    losses: list[torch.Tensor]
    grads: dict[str, torch.Tensor]


def gpt(spec, dtype: torch.dtype, device: torch.device, seed: int = 1234):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=4,
                               hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype,
                               bf16=dtype == torch.bfloat16, init_method_std=INIT_STD)
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=CAPACITY,
                     position_embedding_type="learned_absolute")
    return model.to(device=device, dtype=dtype).train()  # as Megatron's Float16Module casts it


def segments(row) -> list[tuple[int, int]]:
    """(start, real length) of each sequence in the row."""
    starts, ends = row.cu_seqlens_padded.tolist(), row.cu_seqlens.tolist()
    return [(start, b - a) for start, a, b in zip(starts, ends, ends[1:], strict=False)]


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().float().clone() for name, p in model.named_parameters()
            if p.grad is not None}


def packed_pass(model, row, device: torch.device,
                forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
                ) -> Pass:
    """The whole row at once through ``forward(tokens, positions, labels)``."""
    model.zero_grad(set_to_none=True)
    losses = forward(row.tokens.to(device), row.position_ids.to(device), row.labels.to(device))
    (losses.float() * row.loss_mask.to(device)).sum().backward()
    per_sequence = [losses[0, start:start + n].detach().float() for start, n in segments(row)]
    return Pass(per_sequence, _grads(model))


def alone_pass(model, row, device: torch.device,
               forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
               ) -> Pass:
    """Each sequence by itself at positions 0..n-1; gradients summed in float32."""
    per_sequence, total = [], {}
    for start, n in segments(row):
        model.zero_grad(set_to_none=True)
        tokens = row.tokens[:, start:start + n].to(device)
        labels = row.labels[:, start:start + n].to(device)
        positions = torch.arange(n, device=device)[None]
        losses = forward(tokens, positions, labels)
        (losses.float() * row.loss_mask[:, start:start + n].to(device)).sum().backward()
        per_sequence.append(losses[0].detach().float())
        for name, grad in _grads(model).items():
            total[name] = total[name] + grad if name in total else grad
    return Pass(per_sequence, total)


def token_loss_gap(a: Pass, b: Pass) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a.losses, b.losses, strict=True))


def grad_gap(a: Pass, b: Pass, *, per_parameter: bool) -> float:
    """The relative difference of the two gradients: the largest over the parameters one by one,
    or over all of them as one vector (bf16: a norm's bias sums many terms that cancel, so its
    own relative rounding error is large)."""
    assert set(a.grads) == set(b.grads) and a.grads
    keys = sorted(b.grads)
    if per_parameter:
        return max(float((a.grads[k] - b.grads[k]).norm() / b.grads[k].norm().clamp(min=1e-12))
                   for k in keys)
    x = torch.cat([a.grads[k].flatten() for k in keys])
    y = torch.cat([b.grads[k].flatten() for k in keys])
    return float((x - y).norm() / y.norm())


def gaps(packed: Pass, alone: Pass, leaked: Pass, *, per_parameter: bool
         ) -> tuple[float, float, float, float]:
    """(token losses, gradients) of packed against alone, then of the leaking control."""
    return (token_loss_gap(packed, alone), grad_gap(packed, alone, per_parameter=per_parameter),
            token_loss_gap(leaked, alone), grad_gap(leaked, alone, per_parameter=False))


def mask_forward(model, device: torch.device, mask_of: Callable[[int], torch.Tensor]):
    """Local attention given the boolean mask ``mask_of(row length)``."""

    def run(tokens: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor):
        return model(tokens, positions, mask_of(int(tokens.shape[1])).to(device), labels=labels)

    return run


@contextlib.contextmanager
def exact_float32() -> Iterator[None]:
    """TF32 off for matmuls and convolutions while the block runs."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# float32 (per parameter): rounding only; on the CPU the same comparison differs by ~1e-6.
MASK_LOSS_TOL, MASK_GRAD_TOL = 1e-4, 1e-4
# bf16 (all parameters as one vector): THD and one sequence at a time run different kernels;
# the token losses reach ~18 with these weights. A bf16 run of the mask comparison on the CPU
# differs by 0.6% in the gradient.
THD_LOSS_TOL, THD_GRAD_TOL = 0.25, 0.05
# A leak must move the losses and the gradient at least this many times the tolerance (on the
# CPU it moves them by ~9 and ~100%).
LEAK_FACTOR = 10


def mask_equivalence(row, device: torch.device) -> tuple[float, float, float, float]:
    """`gaps` with the block-diagonal mask and local attention, in float32."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_packing.megatron.packed_seq import block_diagonal_causal_mask, causal_mask

    model = gpt(get_gpt_layer_local_spec(), torch.float32, device)
    packed = packed_pass(model, row, device, mask_forward(
        model, device, lambda total: block_diagonal_causal_mask(row.cu_seqlens_padded, total)))
    alone = alone_pass(model, row, device, mask_forward(model, device, causal_mask))
    leaked = packed_pass(model, row, device, mask_forward(model, device, causal_mask))
    return gaps(packed, alone, leaked, per_parameter=True)


def test_packed_equals_unpacked_on_the_gpu_with_the_block_diagonal_mask(nccl_world, row):
    with exact_float32():
        loss_gap, grads_gap, leak_loss, leak_grad = mask_equivalence(row, torch.device("cuda"))
    assert loss_gap <= MASK_LOSS_TOL, f"token losses differ by {loss_gap:.3g}"
    assert grads_gap <= MASK_GRAD_TOL, f"gradients differ by {grads_gap:.3g} (relative norm)"
    assert leak_loss >= LEAK_FACTOR * MASK_LOSS_TOL, f"a leak moved the losses by {leak_loss:.3g}"
    assert leak_grad >= LEAK_FACTOR * MASK_GRAD_TOL, f"a leak moved the gradient by {leak_grad:.3g}"


def thd_equivalence(row, device: torch.device) -> tuple[float, float, float, float]:
    """`gaps` with THD `PackedSeqParams` and Transformer Engine's attention, in bf16."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    from megatron_packing.megatron.packed_seq import packed_seq_params

    model = gpt(get_gpt_layer_with_transformer_engine_spec(), torch.bfloat16, device)

    def thd(params):
        def run(tokens: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor):
            return model(tokens, positions, None, labels=labels, packed_seq_params=params)

        return run

    def causal(tokens: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor):
        return model(tokens, positions, None, labels=labels)

    packed = packed_pass(model, row, device, thd(packed_seq_params(row, device)))
    alone = alone_pass(model, row, device, causal)
    whole = torch.tensor([0, int(row.tokens.shape[1])], dtype=torch.int32)
    one_sequence = {"cu_seqlens": whole, "max_seqlen": int(whole[-1])}
    leaked = packed_pass(model, row, device, thd(packed_seq_params(one_sequence, device)))
    return gaps(packed, alone, leaked, per_parameter=False)


@pytest.mark.skipif(not transformer_engine(),
                    reason="Transformer Engine is not installed: THD attention in megatron-core "
                           "needs it (the block-diagonal mask test covers the local attention)")
def test_packed_equals_unpacked_on_the_gpu_with_thd_packed_seq_params(nccl_world, row):
    loss_gap, grads_gap, leak_loss, leak_grad = thd_equivalence(row, torch.device("cuda"))
    assert loss_gap <= THD_LOSS_TOL, f"token losses differ by {loss_gap:.3g}"
    assert grads_gap <= THD_GRAD_TOL, f"gradients differ by {grads_gap:.3g} (relative norm)"
    assert leak_loss >= LEAK_FACTOR * THD_LOSS_TOL, f"a leak moved the losses by {leak_loss:.3g}"
    assert leak_grad >= LEAK_FACTOR * THD_GRAD_TOL, f"a leak moved the gradient by {leak_grad:.3g}"
