"""Functions run inside spawned gloo processes by the padded-mode / FSDP2 tests.

The references here call the megatron-core model directly, one example per forward, with a
plain causal mask and a float64 cross-entropy: nothing of the padded collator, the schedule,
the dummies or the sharding.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from megatron_packing.config.training import ModelConfig, training_config_from_dict
from megatron_packing.demo.launch import dp_group
from megatron_packing.demo.model import build_tiny_gpt
from megatron_packing.demo.train_step import example_schedule, forward_backward
from megatron_packing.megatron.fsdp2 import wrap_in_fsdp2
from megatron_packing.megatron.packed_seq import causal_mask
from megatron_packing.megatron.step_accounting import examples_the_run_trains
from megatron_packing.padded.collate import PaddedCollator
from megatron_packing.padded.sampler import TokenBudgetBatchSampler

VOCAB = 64
EXAMPLES = 24
GLOBAL_BATCH = 6
BUDGET = 30  # tokens per padded micro-batch: the two ranks' counts differ on some steps
MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, dtype="float64",
                    init_seed=11)


def random_examples(count: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.choice([3, 4, 5, 9, 14, 20])
        ids = np.asarray([rng.randrange(1, VOCAB) for _ in range(n)], dtype=np.int64)
        mask = np.asarray([rng.random() < 0.8 for _ in range(n)], dtype=np.int64)
        mask[-1] = 1  # at least one target after the first token
        out.append({"input_ids": ids, "loss_mask": mask})
    return out


def example_loss_sum(model: torch.nn.Module, ids: np.ndarray, mask: np.ndarray) -> torch.Tensor:
    """Token-sum float64 cross-entropy of one example, alone in a [1, n] forward."""
    n = len(ids)
    tokens = torch.as_tensor(ids, dtype=torch.int64)[None]
    positions = torch.arange(n)[None]
    logits = model(tokens, positions, causal_mask(n))  # [1, n, V]
    losses = F.cross_entropy(logits[0, :-1].double(), tokens[0, 1:], reduction="none")
    return (losses * torch.as_tensor(mask[1:], dtype=torch.float64)).sum()


def _flat_grads(model: torch.nn.Module) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    parts = []
    for p in model.parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if isinstance(g, DTensor):
            g = g.full_tensor()
        parts.append(g.reshape(-1).clone())
    return torch.cat(parts)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def padded_equivalence(rank: int, world: int, out_dir: str) -> None:
    """Per step: padded forward/backward on the replicated and the FSDP2 model vs per-example."""
    examples = random_examples(EXAMPLES, seed=5)
    lengths = np.asarray([len(e["input_ids"]) for e in examples])
    targets = np.asarray([int(e["loss_mask"][1:].sum()) for e in examples])
    settings: dict[str, Any] = {"max_tokens_per_microbatch": BUDGET, "seed": 0}
    mine = TokenBudgetBatchSampler(range(EXAMPLES), lengths, GLOBAL_BATCH, world, dp_rank=rank,
                                   loss_token_counts=targets, **settings)
    whole = TokenBudgetBatchSampler(range(EXAMPLES), lengths, GLOBAL_BATCH, world,
                                    loss_token_counts=targets, **settings)
    collate = PaddedCollator()
    max_len = int(lengths.max())
    plain = build_tiny_gpt(MODEL, vocab_size=VOCAB, max_seq_len=max_len)
    sharded = wrap_in_fsdp2(build_tiny_gpt(MODEL, vocab_size=VOCAB, max_seq_len=max_len),
                            dp_group())
    single = dataclasses.replace(MODEL, dtype="float32")  # FSDP2's float32 reduce-scatter
    sharded32 = wrap_in_fsdp2(build_tiny_gpt(single, vocab_size=VOCAB, max_seq_len=max_len),
                              dp_group())
    sgd_plain = torch.optim.SGD(plain.parameters(), lr=0.5)
    sgd_sharded = torch.optim.SGD(sharded.parameters(), lr=0.5)
    group = dp_group()
    records = []
    for plan, global_plan in zip(mine, whole, strict=True):
        batch = collate.collate([examples[i] for i in plan], plan)
        n_tokens = batch.meta.num_loss_tokens

        plain.zero_grad(set_to_none=True)
        reference = sum(example_loss_sum(plain, examples[i]["input_ids"],
                                         examples[i]["loss_mask"]) for i in global_plan)
        loss_ref = reference / n_tokens
        loss_ref.backward()
        grad_ref = _flat_grads(plain)

        plain.zero_grad(set_to_none=True)
        loss_plain = forward_backward(plain, batch, dp_group=group, loss_from_logits=True)
        grad_plain = _flat_grads(plain)

        sharded.zero_grad(set_to_none=True)
        loss_sharded = forward_backward(sharded, batch, dp_group=group, loss_from_logits=True)
        grad_sharded = _flat_grads(sharded)
        if plan.step == 0:  # same weights as the float64 models only before the first update
            sharded32.zero_grad(set_to_none=True)
            forward_backward(sharded32, batch, dp_group=group)
            grad_rel_float32 = _rel(_flat_grads(sharded32).double(), grad_ref)
        records.append({
            "step": plan.step, "micro_batches": len(batch.micro_batches),
            "dummies": sum(mb is None for mb in batch.micro_batches),
            "rank_real": list(plan.rank_real_microbatches),
            "block_shapes": [list(mb.tokens.shape) for mb in batch.micro_batches if mb is not None],
            "loss_ref": float(loss_ref.detach()), "loss_plain": loss_plain, "loss_sharded": loss_sharded,
            "grad_rel_plain": _rel(grad_plain, grad_ref),
            "grad_rel_sharded": _rel(grad_sharded, grad_ref),
            "grad_norm": float(grad_ref.norm()),
            "grad_rel_float32_step0": grad_rel_float32,
        })
        sgd_plain.step()  # both models move by the padded gradient: later steps compare anew
        sgd_sharded.step()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(records))


def demo_reference(rank: int, world: int, document: dict[str, Any], out_path: str) -> None:
    """Single process, unsharded, one example per forward: the demo run's per-step losses.

    Same data, seed, model, AdamW, LR schedule and clipping as the demo trainer's config.
    """
    from megatron_packing.data import load_sft_dataset
    from megatron_packing.data.tokenize import load_tokenizer
    from megatron_packing.padded.components import build_padded_components

    cfg = training_config_from_dict(document)
    tc = cfg.train
    dataset = load_sft_dataset(cfg.data.paths, cfg.data.tokenizer, cache_dir=cfg.data.cache_dir,
                               show_progress=False)
    sampler, _, _ = build_padded_components(dataset, cfg.packing, dp_rank=None,  # type: ignore[arg-type]
                                            dp_size=tc.dp_size, total_steps=tc.steps)
    model = build_tiny_gpt(cfg.model, vocab_size=len(load_tokenizer(cfg.data.tokenizer)),
                           max_seq_len=int(np.asarray(dataset.lengths).max()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay,
                                  betas=(0.9, 0.95))
    batch_size = cfg.packing.global_batch_size
    scheduler = example_schedule(
        optimizer, lr=tc.lr, min_lr=tc.min_lr, weight_decay=tc.weight_decay,
        warmup_examples=tc.warmup_steps * batch_size,
        total_examples=examples_the_run_trains(tc.steps, len(sampler), len(dataset), batch_size))
    losses = []
    for plan in sampler:
        optimizer.zero_grad(set_to_none=True)
        items = [dataset[i] for i in plan]
        n_tokens = sum(int(np.asarray(e["loss_mask"])[1:].sum()) for e in items)
        assert n_tokens == plan.global_num_loss_tokens
        total = sum(example_loss_sum(model, np.asarray(e["input_ids"]), np.asarray(e["loss_mask"]))
                    for e in items)
        loss = total / n_tokens
        loss.backward()
        if tc.clip_grad:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.clip_grad)
        optimizer.step()
        scheduler.step(increment=len(items))  # the step's real examples, as the demo steps it
        losses.append(float(loss))
    Path(out_path).write_text(json.dumps({"losses": losses,
                                          "plans": [list(p.rank_real_microbatches)
                                                    for p in build_padded_components(
                                                        dataset, cfg.packing, dp_rank=None,  # type: ignore[arg-type]
                                                        dp_size=tc.dp_size,
                                                        total_steps=tc.steps)[0]]}))


def equivalence_and_reference(rank: int, world: int, out_dir: str, document: dict[str, Any]
                              ) -> None:
    """One launch for both: the padded equivalence (every rank), then rank 0's demo reference."""
    padded_equivalence(rank, world, out_dir)
    if rank == 0:
        demo_reference(rank, world, document, str(Path(out_dir, "reference.json")))
