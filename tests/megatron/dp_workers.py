"""Functions run inside spawned gloo data-parallel processes by the tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from packing_helpers import pack_row, random_examples, rank_batches

from megatron_packing.config.training import ModelConfig
from megatron_packing.demo.launch import dp_group
from megatron_packing.demo.model import build_tiny_gpt, per_token_loss
from megatron_packing.demo.train_step import forward_backward

STEP_SIZES = (5, 9, 3, 7)  # global examples per step: varies, one step leaves a placeholder row
VOCAB = 64
CAPACITY = 48


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def packed_vs_unpacked(rank: int, world: int, out_dir: str) -> None:
    """Per step: loss and gradient of packed, one-per-row and single-process reference runs."""
    model = build_tiny_gpt(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                       dtype="float64", init_seed=7),
                           vocab_size=VOCAB, max_seq_len=CAPACITY)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    group = dp_group()
    records = []
    for step, size in enumerate(STEP_SIZES):
        examples = random_examples(size, vocab=VOCAB, min_len=3, max_len=20, seed=100 + step)
        packed, unpacked = rank_batches(step, examples, rank=rank, dp=world, capacity=CAPACITY)

        model.zero_grad(set_to_none=True)
        loss_u = forward_backward(model, unpacked, dp_group=group, loss_from_logits=True)
        grad_u = _grads(model)

        # Reference: every example of the global batch on this process, no DP, no schedule.
        model.zero_grad(set_to_none=True)
        total = sum(
            (per_token_loss(model, row, loss_from_logits=True) * row.loss_mask.double()).sum()
            for row in (pack_row([e]) for e in examples)
        )
        loss_ref = total / packed.meta.num_loss_tokens
        loss_ref.backward()
        grad_ref = _grads(model)

        model.zero_grad(set_to_none=True)
        loss_p = forward_backward(model, packed, dp_group=group, loss_from_logits=True)
        grad_p = _grads(model)
        records.append({
            "step": step, "micro_batches": len(packed.micro_batches),
            "placeholders": sum(r.is_placeholder for r in packed.micro_batches),
            "loss_packed": loss_p, "loss_unpacked": loss_u, "loss_ref": float(loss_ref),
            "grad_rel_packed_unpacked": _rel(grad_p, grad_u),
            "grad_rel_packed_ref": _rel(grad_p, grad_ref),
            "grad_norm": float(grad_p.norm()),
        })
        optimizer.step()  # move the weights so later steps compare at new points
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(records))


def plain_batch_sampler_training(rank: int, world: int, out_dir: str) -> None:
    """Train with a plain torch BatchSampler (every rank reads the whole global batch) and the
    collator packing on its own, keeping this rank's bins: per step, the packed loss and
    gradient against the single-process reference over every example of the step."""
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

    from megatron_packing.config import PackingConfig
    from megatron_packing.packed.collate import PackedCollator

    model = build_tiny_gpt(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                       dtype="float64", init_seed=7),
                           vocab_size=VOCAB, max_seq_len=CAPACITY)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    group = dp_group()
    examples = [{"input_ids": e, "loss_mask": [1] * len(e)}
                for e in random_examples(30, vocab=VOCAB, min_len=3, max_len=20, seed=5)]
    collator = PackedCollator(packing=PackingConfig(bin_capacity=CAPACITY), dp_size=world,
                              dp_rank=rank)
    loader = DataLoader(examples, batch_sampler=BatchSampler(SequentialSampler(examples), 7,
                                                            drop_last=False),
                        collate_fn=collator)
    records = []
    for epoch in range(3):
        for step, (batch, indices) in enumerate(zip(loader, BatchSampler(
                SequentialSampler(examples), 7, drop_last=False), strict=True)):
            model.zero_grad(set_to_none=True)
            total = sum((per_token_loss(model, row, loss_from_logits=True)
                         * row.loss_mask.double()).sum()
                        for row in (pack_row([examples[i]["input_ids"]]) for i in indices))
            loss_ref = total / batch.meta.num_loss_tokens
            loss_ref.backward()
            grad_ref = _grads(model)
            model.zero_grad(set_to_none=True)
            loss = forward_backward(model, batch, dp_group=group, loss_from_logits=True)
            records.append({"epoch": epoch, "step": step, "loss": loss,
                            "loss_ref": float(loss_ref),
                            "grad_rel": _rel(_grads(model), grad_ref),
                            "micro_batches": len(batch.micro_batches),
                            "bins": batch.meta.num_bins,
                            "examples": sorted(i for mb in batch.micro_batches
                                               for i in mb.example_indices)})
            optimizer.step()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(records))


def validation_reference(rank: int, world: int, cfg, run_dir: str, valid_path: str,
                         out_path: str) -> None:
    """The token-mean loss over every example of ``valid_path``, one example per forward, with
    the weights of the run's latest checkpoint (float64 cross-entropy)."""
    import torch.nn.functional as F

    from megatron_packing.data import load_sft_dataset
    from megatron_packing.data.tokenize import load_tokenizer
    from megatron_packing.demo.checkpoint import SHARED, latest_checkpoint
    from megatron_packing.demo.trainer import model_positions
    from megatron_packing.demo.weights import load_model
    from megatron_packing.megatron.packed_seq import causal_mask

    tokenizer = cfg.data.tokenizer
    train_ds = load_sft_dataset(cfg.data.paths, tokenizer, cache_dir=cfg.data.cache_dir,
                                show_progress=False)
    valid_ds = load_sft_dataset([valid_path], tokenizer, cache_dir=cfg.data.cache_dir,
                                show_progress=False)
    model = build_tiny_gpt(cfg.model, vocab_size=len(load_tokenizer(tokenizer)),
                           max_seq_len=model_positions(cfg, train_ds))
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint is not None
    load_model(model, checkpoint / SHARED)  # saved by 2 ranks, read by 1
    model.eval()
    capacity = cfg.packing.bin_capacity
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(len(valid_ds)):
            example = valid_ds[i]
            ids = torch.as_tensor(example["input_ids"], dtype=torch.int64)[:capacity]
            mask = torch.as_tensor(example["loss_mask"], dtype=torch.float64)[:capacity]
            n = len(ids)
            logits = model(ids[None], torch.arange(n)[None], causal_mask(n))
            losses = F.cross_entropy(logits[0, :-1].double(), ids[1:], reduction="none")
            total += float((losses * mask[1:]).sum())
            tokens += int(mask[1:].sum())
    Path(out_path).write_text(json.dumps({"loss": total / tokens, "checkpoint": checkpoint.name}))
