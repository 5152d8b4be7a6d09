"""Hand-made packed rows for tests, laid out exactly as `megatron_packing.packed.collate` documents."""

from __future__ import annotations

import random

import torch

from megatron_packing.common.plan_types import StepMetadata
from megatron_packing.packed.collate import PackedBatch, PackedMicroBatch


def pack_row(seqs: list[list[int]], *, seq_multiple: int = 1, pad_id: int = 0,
             indices: tuple[int, ...] = ()) -> PackedMicroBatch:
    """Sequences end to end; each padded to ``seq_multiple``; every next-token label trained."""
    real = [0]
    padded = [0]
    for s in seqs:
        real.append(real[-1] + len(s))
        padded.append(padded[-1] + -(-len(s) // seq_multiple) * seq_multiple)
    total = padded[-1]
    tokens = torch.full((1, total), pad_id, dtype=torch.int64)
    labels = torch.full((1, total), pad_id, dtype=torch.int64)
    loss_mask = torch.zeros((1, total), dtype=torch.float32)
    positions = torch.zeros((1, total), dtype=torch.int64)
    for i, s in enumerate(seqs):
        start, n = padded[i], len(s)
        tokens[0, start:start + n] = torch.tensor(s)
        labels[0, start:start + n - 1] = torch.tensor(s[1:])
        loss_mask[0, start:start + n - 1] = 1.0
        positions[0, start:padded[i + 1]] = torch.arange(padded[i + 1] - start)
    return PackedMicroBatch(
        tokens=tokens, labels=labels, loss_mask=loss_mask, position_ids=positions,
        cu_seqlens=torch.tensor(real, dtype=torch.int32),
        cu_seqlens_padded=torch.tensor(padded, dtype=torch.int32),
        max_seqlen=max(padded[i + 1] - padded[i] for i in range(len(seqs))),
        example_indices=indices,
    )


def placeholder_row(pad_id: int = 0) -> PackedMicroBatch:
    row = pack_row([[pad_id]], pad_id=pad_id)
    row.is_placeholder = True
    row.loss_mask.zero_()
    return row


def random_examples(count: int, *, vocab: int, min_len: int, max_len: int,
                    seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(count)]


def first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of positions into ``lengths`` (first fit, order kept)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        for b, r in enumerate(room):
            if n <= r:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins


def meta_for(step: int, examples: list[list[int]], num_bins: int, dp: int) -> StepMetadata:
    return StepMetadata(
        step=step, epoch=0, num_examples=len(examples),
        num_tokens=sum(len(e) for e in examples),
        num_loss_tokens=sum(len(e) - 1 for e in examples),
        num_bins=num_bins, num_padding_bins=0, num_placeholder_bins=0,
        micro_batches_per_rank=num_bins // dp, token_fill=0.0, dp_imbalance=1.0,
        plan_ms=0.0, aligned=num_bins % dp == 0)


def rank_batches(step: int, examples: list[list[int]], *, rank: int, dp: int, capacity: int,
                 seq_multiple: int = 2) -> tuple[PackedBatch, PackedBatch]:
    """(packed, unpacked) batches of one global step for ``rank``.

    Bins go round robin to ranks; a rank short of bins gets placeholder rows. The unpacked batch
    holds the same examples as this rank's bins, one per row, unpadded.
    """
    aligned = [-(-len(e) // seq_multiple) * seq_multiple for e in examples]
    bins = first_fit(aligned, capacity)
    per_rank = -(-len(bins) // dp)
    mine = bins[rank::dp]
    rows = [pack_row([examples[i] for i in b], seq_multiple=seq_multiple, indices=tuple(b))
            for b in mine]
    rows += [placeholder_row() for _ in range(per_rank - len(rows))]
    meta = meta_for(step, examples, per_rank * dp, dp)
    meta.num_placeholder_bins = per_rank * dp - len(bins)
    unpacked_rows = [pack_row([examples[i]], indices=(i,)) for b in mine for i in b]
    unpacked_rows = unpacked_rows or [placeholder_row()]
    unpacked_meta = meta_for(step, examples, per_rank * dp, dp)
    unpacked_meta.micro_batches_per_rank = 0  # counts differ between ranks here
    return PackedBatch(rows, meta), PackedBatch(unpacked_rows, unpacked_meta)
