"""Hand-made packed rows for the batch-format tests (the layout `megatron_packing.collate` documents)."""

from __future__ import annotations

import random

import torch

from megatron_packing.collate import PackedMicroBatch


def pack_row(seqs: list[list[int]], *, seq_multiple: int = 1, pad_id: int = 0) -> PackedMicroBatch:
    """Sequences end to end, each padded to ``seq_multiple``; every next-token label trained."""
    real, padded = [0], [0]
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
    )


def random_rows(count: int, *, seed: int, seq_multiple: int = 4) -> list[PackedMicroBatch]:
    """Rows whose length and sequence count vary; most sequences need alignment padding."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        seqs = [[rng.randrange(1, 97) for _ in range(rng.randint(2, 23))]
                for _ in range(rng.randint(1, 6))]
        rows.append(pack_row(seqs, seq_multiple=seq_multiple))
    return rows
