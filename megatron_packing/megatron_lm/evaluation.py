"""Validation for the Megatron-LM entry point: the validation loader's own steps, Megatron's report.

Megatron-LM's ``evaluate()`` runs a fixed ``global_batch_size / (micro_batch_size x dp)``
micro-batches per step, which packed rows do not have (a step of B examples packs into far
fewer rows, and their count varies). So the steps are the validation loader's: B examples in
sequential order, packed, with placeholder rows where a rank runs short. What Megatron does
around them is kept: the rerun state machine is off while evaluating, the loss is the token
mean over the evaluated steps, and the result is printed and written under Megatron's names
(``lm loss validation``, ``... vs samples``, ``... ppl`` with
``--log-validation-ppl-to-tensorboard``) so existing dashboards read it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_packing.megatron_lm.step import run_step


@dataclass
class Validation:
    """``eval_iters`` steps of the validation loader (from its start each time), forward only."""

    loader: Any  # the validation loader; one pass is len(loader) steps
    eval_iters: int
    model: list[Any]
    forward_step: Callable
    dp_size: int
    pad_token_id: int
    width_multiple: int = 1  # padded mode: block widths rounded up to this (sequence parallel)

    def losses(self) -> dict[str, float]:
        """Token-mean loss per reported key; training state untouched."""
        from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine


        machine = get_rerun_state_machine()
        mode = machine.get_mode()
        machine.set_mode(RerunMode.DISABLED)
        for chunk in self.model:
            chunk.eval()
        totals: dict[str, torch.Tensor] = {}
        steps = 0
        try:
            with torch.no_grad():
                for batch in self.loader:
                    if steps == self.eval_iters:
                        break
                    outcome = run_step(batch, model=self.model, optimizer=None, scheduler=None,
                                       forward_step=self.forward_step, dp_size=self.dp_size,
                                       pad_token_id=self.pad_token_id, forward_only=True,
                                       width_multiple=self.width_multiple)
                    for key, sums in outcome.loss_sums.items():
                        totals[key] = totals.get(key, torch.zeros(2, dtype=torch.float64)) + sums
                    steps += 1
        finally:
            for chunk in self.model:
                chunk.train()
            machine.set_mode(mode)
        if steps < self.eval_iters:
            raise RuntimeError(f"the validation set gave {steps} steps, --eval-iters asks "
                               f"{self.eval_iters}")
        return {key: float(s[0] / s[1]) if s[1] > 0 else float("nan")
                for key, s in totals.items()}

    def run(self, prefix: str, iteration: int, *, write: bool = True) -> float | None:
        """Evaluate, print Megatron's validation line and write Megatron's metric names.

        Returns the LM loss (None off the last pipeline stage, which computes no loss).
        """
        from megatron.training import get_args, get_tensorboard_writer, get_wandb_writer
        from megatron.training.utils import is_last_rank, print_rank_last

        args = get_args()
        losses = self.losses()
        writer = get_tensorboard_writer() if write else None
        wandb_writer = get_wandb_writer() if write else None
        line = f" validation loss at {prefix} | "
        for key, value in losses.items():
            ppl = math.exp(min(20.0, value))
            line += f"{key} value: {value:.6E} | {key} PPL: {ppl:.6E} | "
            if writer is not None:
                writer.add_scalar(f"{key} validation", value, iteration)
                writer.add_scalar(f"{key} validation vs samples", value,
                                  args.consumed_train_samples)
                if args.log_validation_ppl_to_tensorboard:
                    writer.add_scalar(f"{key} validation ppl", ppl, iteration)
                    writer.add_scalar(f"{key} validation ppl vs samples", ppl,
                                      args.consumed_train_samples)
            if wandb_writer is not None and is_last_rank():
                wandb_writer.log({f"{key} validation": value}, iteration)
        print_rank_last("-" * (len(line) + 1))
        print_rank_last(line)
        print_rank_last("-" * (len(line) + 1))
        return losses.get("lm loss")
