"""Packing-invariant loss: a token sum divided once by the step's GLOBAL loss-token count.

Why: the gradient of a step must be d(sum of token losses over the global batch / N) with N
the global number of loss tokens, whatever way the examples were split into rows and ranks.
A mean of per-row means (the classic micro-batch loss) weights a token by 1 / (tokens in its
row), so it changes with packing. N comes from the plan (`StepMetadata.num_loss_tokens`), which
is identical on every rank, so no collective is needed to know it.

How it composes with megatron-core's schedule and DP reduction (model config
``calculate_per_token_loss=True``):

* The loss function returns ``(sum_local / N, local_tokens, report)``. With the per-token flag
  the schedule does not divide the returned loss by ``num_microbatches`` (without the flag it
  would, and a varying micro-batch count would change the gradient's scale each step).
* Backward over this rank's micro-batches accumulates ``sum_{rank's tokens} dl / N``.
* DP reduction must then SUM gradients over ranks (not average): the result is
  ``sum_{all tokens} dl / N``, the exact global gradient. `train_step` installs such a
  reduction as the schedule's ``finalize_model_grads_func``.
* Placeholder rows have an all-zero loss mask, so they add exactly zero to loss and gradient.

Megatron-LM's own loop reaches the same result differently (``--calculate-per-token-loss``:
the loss returns the raw sum and its token count, DDP sums gradients, and
``finalize_model_grads`` divides by the all-reduced count, which equals N); see
`megatron_packing.megatron.step_accounting.megatron_lm_loss_func`.

With a megatron-core ``DistributedDataParallel`` model `train_step` takes Megatron's route
instead: the loss function returns the raw token sum (``make_loss_func(..., raw_sum=True)``),
the DDP sums the ``main_grad`` buffers and ``finalize_model_grads`` divides once by the
all-reduced token count, which `reduce_reported_loss` checks equals N. (Megatron rounds that
1/count to float32, so a float64 run matches the plain path to about 3e-8 relative, not 1e-15.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LossReport = dict[str, torch.Tensor]
LossFunc = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, LossReport]]
"""One micro-batch's loss in the schedule's protocol: (loss, loss tokens, report to reduce)."""


def masked_loss_sum(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sum of per-token losses where the mask is set (shapes [b, s]; computed in the loss dtype)."""
    mask = loss_mask.to(per_token_loss.dtype)
    return (per_token_loss * mask).sum()


def loss_token_count(global_loss_tokens: int | None) -> int:
    """N as an int: refuse an unknown (None) or negative count instead of guessing one."""
    if global_loss_tokens is None:
        raise ValueError(
            "the step's global loss-token count is unknown (None), so the loss cannot be divided "
            "by it: build the sampler with loss_token_counts (a dataset with a length index, "
            "e.g. load_sft_dataset, provides them) instead of dividing by a guess"
        )
    if isinstance(global_loss_tokens, bool) or int(global_loss_tokens) != global_loss_tokens \
            or global_loss_tokens < 0:
        raise ValueError(f"global_loss_tokens must be a count >= 0, got {global_loss_tokens!r}")
    return int(global_loss_tokens)


def loss_divisor(global_loss_tokens: int | None) -> float:
    """N as a divisor (see `loss_token_count` for what is refused).

    A step with N = 0 trains nothing (every loss term is zero), so 1 is used to avoid 0 / 0.
    """
    return float(max(loss_token_count(global_loss_tokens), 1))


def make_loss_func(
    loss_mask: torch.Tensor, global_loss_tokens: int | None, *, grad_reduce_divisor: int = 1,
    raw_sum: bool = False,
) -> LossFunc:
    """Loss function for one micro-batch, in the schedule's 3-tuple protocol.

    ``global_loss_tokens`` is N from the step's metadata; ``None`` (unknown) is refused.
    ``grad_reduce_divisor`` is the factor by which the DP gradient reduction divides (1 for a
    SUM reduction, dp for an averaging one); the loss is multiplied by it so that the reduced
    gradient is still the global one. ``raw_sum`` returns the undivided token sum, for
    megatron-core DDP, whose ``finalize_model_grads`` divides by the all-reduced count.
    Needs ``calculate_per_token_loss=True`` in the model config (no division by micro-batches).
    """
    divisor = loss_divisor(global_loss_tokens)
    if raw_sum:
        divisor, grad_reduce_divisor = 1.0, 1

    def loss_func(per_token_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, LossReport]:
        total = masked_loss_sum(per_token_loss, loss_mask)
        tokens = loss_mask.sum().to(torch.int)
        scaled = total * (grad_reduce_divisor / divisor)
        report = {"loss_sum": total.detach().to(torch.float64), "loss_tokens": tokens.detach()}
        return scaled, tokens, report

    return loss_func


def reduce_reported_loss(reports: list[LossReport], global_loss_tokens: int | None,
                         group: torch.distributed.ProcessGroup | None = None, *,
                         check_tokens: bool = False) -> float:
    """The step's loss for logging: all ranks' token-loss sums / N (a collective over ``group``).

    ``check_tokens``: raise unless the loss masks hold N tokens in all (when the gradient is
    divided by the counted tokens, as megatron-core DDP does, a wrong N would make the logged
    loss and the gradient disagree).
    """
    expected = loss_token_count(global_loss_tokens)
    divisor = loss_divisor(expected)
    local = torch.zeros(2, dtype=torch.float64)  # [token-loss sum, loss tokens]
    for report in reports:
        local[0] += report["loss_sum"]
        local[1] += report["loss_tokens"].to(torch.float64)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(local, group=group)
    counted = int(local[1].item())
    if check_tokens and counted != expected:
        raise ValueError(f"the loss masks hold {counted} loss tokens over all ranks but the "
                         f"step metadata says num_loss_tokens={global_loss_tokens}")
    return float(local[0].item()) / divisor
