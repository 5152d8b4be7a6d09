"""megatron-core pieces the Megatron-LM entry point (`megatron_packing.megatron_lm`) builds on.

Megatron-LM reads ``get_num_microbatches()`` every step and counts ``consumed_train_samples``
as dp x micro_batch_size x num_microbatches (rows, not examples). With DP-aligned packing the
row count varies per step, so:

* `sync_num_microbatches` sets megatron-core's calculator to the step's count before the step
  runs, so that everything reading it agrees with the plan;
* `ConsumedExamples` counts real examples and tokens from the plan's metadata;
* `megatron_lm_loss_func` is the loss for ``--calculate-per-token-loss``: DDP sums gradients
  and ``finalize_model_grads`` divides by the all-reduced loss-token count, which equals the
  plan's ``num_loss_tokens`` (placeholder rows add zero tokens).

Megatron-LM's own ``train()`` cannot host a per-step count (it asserts that the count never
falls); the entry point runs its own step loop over Megatron's pieces instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_packing.common.plan_types import StepMetadata


def sync_num_microbatches(meta: StepMetadata, *, dp_size: int, rank: int = 0) -> int:
    """Make megatron-core's calculator report this step's micro-batches per rank; return it.

    The step's rows (``num_bins``, a multiple of dp) become the calculator's global batch size
    with a micro-batch size of 1 row, so ``get_num_microbatches() == num_bins / dp``. The
    calculator is rebuilt (and megatron-core logs it, on ``rank`` 0) only when the count changes.
    """
    from megatron.core.num_microbatches_calculator import (
        get_current_global_batch_size,
        get_micro_batch_size,
        get_num_microbatches,
        reconfigure_num_microbatches_calculator,
    )

    if meta.num_bins % dp_size != 0:
        raise ValueError(f"step {meta.step}: {meta.num_bins} bins do not divide by dp={dp_size}")
    if (get_current_global_batch_size(), get_micro_batch_size()) != (meta.num_bins, 1):
        reconfigure_num_microbatches_calculator(rank=rank, rampup_batch_size=None,
                                                global_batch_size=meta.num_bins,
                                                micro_batch_size=1, data_parallel_size=dp_size)
    count = get_num_microbatches()
    if count != meta.micro_batches_per_rank:
        raise RuntimeError(f"calculator reports {count} micro-batches, the plan "
                           f"{meta.micro_batches_per_rank}")
    return count


def lr_increment(meta: StepMetadata) -> int:
    """How far a step moves Megatron's LR schedule: its real examples, never its rows.

    Megatron-LM sizes ``--lr-decay-samples`` / ``--lr-warmup-samples`` (and, from iterations,
    ``--global-batch-size`` x iterations) in samples and steps the scheduler by a step's
    samples. A packed step's rows (bins) vary with packing, so stepping by rows would end the
    decay early or late; its examples are what the schedule was sized in.
    """
    return int(meta.num_examples)


def examples_the_run_trains(train_iters: int, steps_per_epoch: int, num_examples: int,
                            batch_size: int) -> int:
    """Real examples over ``train_iters`` steps: whole epochs of N, then ``steps x B``."""
    epochs, rest = divmod(train_iters, steps_per_epoch)
    return epochs * num_examples + rest * batch_size



@dataclass
class ConsumedExamples:
    """Real examples and tokens trained on so far (not rows). Checkpoint it with the model."""

    examples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    steps: int = 0

    def update(self, meta: StepMetadata) -> None:
        self.examples += int(meta.num_examples)
        self.tokens += int(meta.num_tokens)
        if meta.num_loss_tokens is None:
            raise ValueError(
                f"step {meta.step}: the loss-token count is unknown (None), so consumed loss tokens "
                "cannot be counted; build the sampler with loss_token_counts"
            )
        self.loss_tokens += int(meta.num_loss_tokens)
        self.steps += 1

    def state_dict(self) -> dict[str, int]:
        return {"examples": self.examples, "tokens": self.tokens,
                "loss_tokens": self.loss_tokens, "steps": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.examples, self.tokens = int(state["examples"]), int(state["tokens"])
        self.loss_tokens, self.steps = int(state["loss_tokens"]), int(state["steps"])


SPIKY_LOSS_FACTOR = 10
"""A loss ten times the largest seen so far is a spike (the factor Megatron-LM's GPT loss uses)."""


def megatron_lm_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, *,
                          check_nan: bool = False, check_spiky: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Loss for Megatron-LM with ``--calculate-per-token-loss``: (token sum, token count, report).

    The loop divides the DP-summed gradient by the all-reduced count once: the global mean.
    ``check_nan`` (Megatron's ``--check-for-nan-in-loss-and-grad``) and ``check_spiky``
    (``--check-for-spiky-loss``) hand this rank's loss to megatron-core's rerun state machine
    before any reduction, as Megatron-LM's own GPT loss does: a NaN or Inf is fatal, a spike is
    reported. What follows (rerun in place, checkpoint and exit) is the state machine's.
    """
    dtype = torch.promote_types(output_tensor.dtype, torch.float32)  # fp32 sums, fp64 kept
    mask = loss_mask.reshape(-1).to(dtype)
    total = (output_tensor.reshape(-1).to(dtype) * mask).sum()
    tokens = mask.sum().to(torch.int)
    if check_nan or check_spiky:
        _validate_loss(total, check_nan=check_nan, check_spiky=check_spiky)
    report = torch.stack([total.detach(), tokens.detach().to(dtype)])
    return total, tokens, {"lm loss": report}


def _validate_loss(loss: torch.Tensor, *, check_nan: bool, check_spiky: bool) -> None:
    from functools import partial

    from megatron.core.rerun_state_machine import get_rerun_state_machine

    machine = get_rerun_state_machine()
    if check_nan:
        machine.validate_result(result=loss, rejection_func=torch.isnan,
                                message="found NaN in local forward loss calculation",
                                tolerance=0.0, fatal=True)
        machine.validate_result(result=loss, rejection_func=torch.isinf,
                                message="found Inf in local forward loss calculation",
                                tolerance=0.0, fatal=True)
    if check_spiky:
        machine.validate_result(
            result=loss,
            rejection_func=partial(machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR,
                                   context="loss"),
            message="Spiky loss", tolerance=0.0, fatal=False)
