"""Adapter for Megatron-LM's own training loop (``pretrain()`` with ``--dataloader-type external``).

Megatron-LM reads ``get_num_microbatches()`` at the start of every step, then pulls that many
micro-batches from the data iterator, and counts ``consumed_train_samples`` as
dp x micro_batch_size x num_microbatches (rows, not examples). With DP-aligned packing the
number of rows varies per step, so:

* `PackedStepIterator` yields micro-batch dicts one at a time. It reads one step ahead: when
  a step's last micro-batch has been handed out, it fetches the next step and reconfigures the
  num-microbatches calculator (`sync_num_microbatches`), so the count the loop reads next is
  that step's. It is primed the same way at construction.
* `ConsumedExamples` counts real examples and tokens from the plan's metadata; use it instead
  of ``consumed_train_samples`` for anything that means "examples seen".

Loss: run with ``--calculate-per-token-loss`` and return `megatron_lm_loss_func`'s result;
DDP then sums gradients and ``finalize_model_grads`` divides by the all-reduced loss-token
count, which equals the plan's ``num_loss_tokens`` (placeholder rows add zero tokens).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron_packing.collate import PackedBatch, PackedMicroBatch, StepMetadata


def sync_num_microbatches(meta: StepMetadata, *, dp_size: int, rank: int = 0) -> int:
    """Make megatron-core's calculator report this step's micro-batches per rank; return it.

    The step's rows (``num_bins``, a multiple of dp) become the calculator's global batch size
    with a micro-batch size of 1 row, so ``get_num_microbatches() == num_bins / dp``.
    """
    from megatron.core.num_microbatches_calculator import (
        get_num_microbatches,
        reconfigure_num_microbatches_calculator,
    )

    if meta.num_bins % dp_size != 0:
        raise ValueError(f"step {meta.step}: {meta.num_bins} bins do not divide by dp={dp_size}")
    reconfigure_num_microbatches_calculator(rank=rank, rampup_batch_size=None,
                                            global_batch_size=meta.num_bins, micro_batch_size=1,
                                            data_parallel_size=dp_size)
    count = get_num_microbatches()
    if count != meta.micro_batches_per_rank:
        raise RuntimeError(f"calculator reports {count} micro-batches, the plan "
                           f"{meta.micro_batches_per_rank}")
    return count


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


def micro_batch_dict(mb: PackedMicroBatch, meta: StepMetadata) -> dict[str, Any]:
    """What a Megatron-LM ``forward_step`` needs from one row (THD params built on demand)."""
    return {
        "tokens": mb.tokens, "labels": mb.labels, "loss_mask": mb.loss_mask,
        "position_ids": mb.position_ids, "cu_seqlens": mb.cu_seqlens,
        "cu_seqlens_padded": mb.cu_seqlens_padded, "max_seqlen": mb.max_seqlen,
        "is_placeholder": mb.is_placeholder, "num_loss_tokens_global": meta.num_loss_tokens,
        "micro_batch": mb,
    }


class PackedStepIterator:
    """Flattens the loader's steps into micro-batches, keeping the calculator one step ahead.

    Give Megatron-LM ``iter(PackedStepIterator(loader, dp_size=..., rank=...))`` from the
    ``train_valid_test_datasets_provider`` together with ``--dataloader-type external``.
    """

    def __init__(self, steps: Iterable[PackedBatch], *, dp_size: int, rank: int = 0,
                 counter: ConsumedExamples | None = None) -> None:
        self._steps = iter(steps)
        self.dp_size = dp_size
        self.rank = rank
        self.counter = counter if counter is not None else ConsumedExamples()
        self._pending: list[PackedMicroBatch] = []
        self._meta: StepMetadata | None = None
        self._prime()

    def _prime(self) -> None:
        batch = next(self._steps, None)
        if batch is None:
            self._meta = None
            return
        self._meta = batch.meta
        self._pending = list(batch.micro_batches)
        sync_num_microbatches(batch.meta, dp_size=self.dp_size, rank=self.rank)

    @property
    def current_meta(self) -> StepMetadata | None:
        """Metadata of the step whose micro-batches are being handed out."""
        return self._meta

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._meta is None:
            raise StopIteration
        meta = self._meta
        item = micro_batch_dict(self._pending.pop(0), meta)
        if not self._pending:
            self.counter.update(meta)
            self._prime()
        return item


def megatron_lm_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Loss for Megatron-LM with ``--calculate-per-token-loss``: (token sum, token count, report).

    The loop divides the DP-summed gradient by the all-reduced count once: the global mean.
    """
    mask = loss_mask.reshape(-1).to(output_tensor.dtype)
    total = (output_tensor.reshape(-1).float() * mask.float()).sum()
    tokens = mask.sum().to(torch.int)
    report = torch.stack([total.detach(), tokens.detach().float()])
    return total, tokens, {"lm loss": report}
