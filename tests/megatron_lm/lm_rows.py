"""Hand-made packed rows for the batch-format tests (the layout `megatron_packing.packed.collate` documents)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

from megatron_packing.packed.collate import PackedMicroBatch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
from packing_helpers import pack_row  # noqa: E402


def random_rows(count: int, *, seed: int, seq_multiple: int = 4) -> list[PackedMicroBatch]:
    """Rows whose length and sequence count vary; most sequences need alignment padding."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        seqs = [[rng.randrange(1, 97) for _ in range(rng.randint(2, 23))]
                for _ in range(rng.randint(1, 6))]
        rows.append(pack_row(seqs, seq_multiple=seq_multiple))
    return rows
