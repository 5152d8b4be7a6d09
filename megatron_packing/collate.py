"""Plan + fetched examples -> a step of packed micro-batches (THD layout, torch tensors).

The collator never packs: the sampler's plan already says which examples share a bin. One bin
becomes one micro-batch. A rank whose share of the step holds fewer real bins than the step's
micro-batch count receives placeholder rows: valid, minimal-length rows with zero loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PackedMicroBatch:
    """One bin in THD layout: sequences laid end to end in a single row.

    ``cu_seqlens`` holds the real (unpadded) sequence boundaries; ``cu_seqlens_padded`` holds
    the aligned ones, and its last entry is the row length. Sequence ``i`` occupies
    ``tokens[0, cu_seqlens_padded[i] : cu_seqlens_padded[i] + (cu_seqlens[i+1] - cu_seqlens[i])]``;
    the rest of its aligned segment is padding with zero loss.
    """

    tokens: torch.Tensor  # [1, T] int64
    labels: torch.Tensor  # [1, T] int64, next token within the same sequence
    loss_mask: torch.Tensor  # [1, T] float32, 1 where labels[t] is trained on
    position_ids: torch.Tensor  # [1, T] int64, restarting at 0 for every sequence
    cu_seqlens: torch.Tensor  # [n + 1] int32
    cu_seqlens_padded: torch.Tensor  # [n + 1] int32
    max_seqlen: int  # longest aligned sequence in the row
    example_indices: tuple[int, ...] = ()  # dataset indices; empty for a placeholder row
    is_placeholder: bool = False

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens in the row."""
        return int(self.cu_seqlens[-1].item()) if not self.is_placeholder else 0


@dataclass
class StepMetadata:
    """Global facts about one step, identical on every rank (they come from the shared plan)."""

    step: int
    epoch: int
    num_examples: int  # real examples in the global batch (train/actual_batch_size)
    num_tokens: int  # real tokens in the global batch
    num_loss_tokens: int  # tokens trained on, global: the loss divisor
    num_bins: int  # micro-batches over all ranks (a multiple of dp)
    num_padding_bins: int  # bins added beyond the packer's count to reach a multiple of dp
    num_placeholder_bins: int  # bins with no example at all (zero-loss placeholder rows)
    micro_batches_per_rank: int
    token_fill: float  # real tokens / (bins x capacity)
    dp_imbalance: float  # max-rank cost / mean-rank cost
    plan_ms: float  # time spent planning this step
    aligned: bool  # bin count reached a multiple of dp without padding bins
    is_eval: bool = False
    extra: dict[str, float] = field(default_factory=dict)


@dataclass
class PackedBatch:
    """This rank's micro-batches for one step, plus the step's global metadata."""

    micro_batches: list[PackedMicroBatch]
    meta: StepMetadata

    def __len__(self) -> int:
        return len(self.micro_batches)
