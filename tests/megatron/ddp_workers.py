"""Spawned gloo ranks for the megatron-core DDP train-step test (`test_ddp_train_step.py`)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from packing_helpers import pack_row, random_examples, rank_batches

from megatron_packing.config.training import ModelConfig
from megatron_packing.demo.launch import dp_group
from megatron_packing.demo.model import build_tiny_gpt, per_token_loss
from megatron_packing.demo.train_step import forward_backward, train_step
from megatron_packing.megatron.ddp import build_megatron_optimizer, wrap_in_ddp

STEP_SIZES = (5, 9, 3, 7)  # global examples per step: varies, one step leaves a placeholder row
VOCAB = 64
CAPACITY = 48
# (name, use_distributed_optimizer, overlap_grad_reduce): overlap exercises the schedule's
# no_sync_func / grad_sync_func hooks; small buckets make several reductions per step.
SETUPS = (("distopt_overlap", True, True), ("ddp", False, False))
MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, dtype="float64",
                    init_seed=7)


def _tiny_gpt() -> torch.nn.Module:
    return build_tiny_gpt(MODEL, vocab_size=VOCAB, max_seq_len=CAPACITY)


def _reduced_main_grads(ddp: torch.nn.Module, rank: int, world: int) -> dict[str, torch.Tensor]:
    """Every parameter's finalized ``main_grad``, by name, as this rank holds it.

    With the distributed optimizer each rank holds only its reduce-scattered shard of every
    bucket; the shards are gathered into a copy (the DDP's own buffers stay untouched).
    """
    sharded = ddp.ddp_config.use_distributed_optimizer
    by_param: dict[torch.nn.Parameter, torch.Tensor] = {}
    for buffer in ddp.buffers:
        full = buffer.grad_data.clone()
        if sharded:
            for bucket in buffer.buckets:
                view = full[bucket.offset:bucket.offset + bucket.grad_data.numel()]
                shard = view.numel() // world
                mine = bucket.grad_data[rank * shard:(rank + 1) * shard].clone()
                dist.all_gather_into_tensor(view, mine)
        for param, (start, end, _) in buffer.param_index_map.items():
            by_param[param] = full[start:end].view(param.shape)
    return {name: by_param[p] for name, p in ddp.module.named_parameters()}


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads.values()])


def _reference(reference: torch.nn.Module, examples: list[list[int]], num_loss_tokens: int
               ) -> tuple[float, torch.Tensor]:
    """Loss and gradient of the whole global batch on this process: no DDP, no schedule."""
    reference.zero_grad(set_to_none=True)
    total = sum(
        (per_token_loss(reference, row, loss_from_logits=True) * row.loss_mask.double()).sum()
        for row in (pack_row([e]) for e in examples)
    )
    loss = total / num_loss_tokens
    loss.backward()
    return float(loss), torch.cat([p.grad.reshape(-1) for p in reference.parameters()])


def _check_guards(ddp: torch.nn.Module, batch) -> list[str]:
    """Misuse raises: a torch optimizer would read the empty ``.grad`` and update nothing."""
    errors = []
    try:
        train_step(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), batch, loss_from_logits=True)
    except TypeError as err:
        errors.append(str(err))
    return errors


def ddp_train_steps(rank: int, world: int, out_dir: str) -> None:
    """Every setup of `SETUPS` in turn, one file per setup and rank."""
    for name, distributed, overlap in SETUPS:
        torch.save(_run_setup(rank, world, distributed, overlap),
                   Path(out_dir, f"{name}_rank{rank}.pt"))


def _run_setup(rank: int, world: int, distributed: bool, overlap_grad_reduce: bool) -> dict:
    """Per step: packed vs unpacked vs reference loss and main_grad, then a real optimizer step."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    ddp = wrap_in_ddp(_tiny_gpt(), DistributedDataParallelConfig(
        grad_reduce_in_fp32=False, use_distributed_optimizer=distributed,
        overlap_grad_reduce=overlap_grad_reduce, bucket_size=20_000))
    optimizer = build_megatron_optimizer(ddp, OptimizerConfig(
        optimizer="adam", lr=1e-2, clip_grad=0.0, use_distributed_optimizer=distributed,
        bf16=False, fp16=False))
    reference = _tiny_gpt()
    names = [name for name, _ in reference.named_parameters()]
    group = dp_group()
    records = []
    for step, size in enumerate(STEP_SIZES):
        examples = random_examples(size, vocab=VOCAB, min_len=3, max_len=20, seed=100 + step)
        packed, unpacked = rank_batches(step, examples, rank=rank, dp=world, capacity=CAPACITY)
        reference.load_state_dict(ddp.module.state_dict())
        loss_ref, grad_ref = _reference(reference, examples, packed.meta.num_loss_tokens)

        ddp.zero_grad_buffer()
        loss_u = forward_backward(ddp, unpacked, dp_group=group, loss_from_logits=True)
        grad_u = _flat(_reduced_main_grads(ddp, rank, world))
        ddp.zero_grad_buffer()
        loss_p = forward_backward(ddp, packed, dp_group=group, loss_from_logits=True)
        grads_p = _reduced_main_grads(ddp, rank, world)
        grad_p = _flat(grads_p)

        result = train_step(ddp, optimizer, packed, dp_group=group, loss_from_logits=True)
        records.append({
            "step": step, "micro_batches": len(packed.micro_batches),
            "placeholders": sum(r.is_placeholder for r in packed.micro_batches),
            "loss_packed": loss_p, "loss_unpacked": loss_u, "loss_ref": loss_ref,
            "grad_packed": grad_p, "grad_unpacked": grad_u, "grad_ref": grad_ref,
            "step_loss": result.loss, "step_grad_norm": result.grad_norm,
            "update_successful": result.update_successful,
            "params_after": torch.cat([p.detach().reshape(-1).clone()
                                       for p in ddp.module.parameters()]),
        })
    return {"names": names, "records": records, "guard_errors": _check_guards(ddp, packed),
            "param_dtype": str(next(ddp.module.parameters()).dtype),
            "grad_dtype": str(ddp.buffers[0].grad_data.dtype),
            "buckets": sum(len(b.buckets) for b in ddp.buffers)}
