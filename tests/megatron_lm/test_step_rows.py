"""Every row a step trains carries exactly the plan's loss tokens, at any TP size and with PP.

The loss is a token sum divided once by the step's global loss-token count (`StepMetadata`), so
a padding column that carries loss, or a dummy micro-batch that trains a token, changes the
gradient without any error. Each step here is planned and collated as the entry point's loader
does (the components `build_sft_dataloader` builds), for every data-parallel rank, then turned
into the rows the schedule runs (`step_rows`): in padded mode, blocks widened to the TP size
(sequence parallelism splits their width) and one-row dummies where a rank runs short; in packed
mode, rows aligned to the TP size and, with pipeline stages, padded to the step's longest row.
"""

from __future__ import annotations

from itertools import islice

import numpy as np
import pytest
import torch

from megatron_packing.config import PackingConfig
from megatron_packing.megatron.step_rows import step_rows
from megatron_packing.packed.collate import PackedBatch, PackedMicroBatch
from megatron_packing.packed.components import build_packed_components
from megatron_packing.padded.collate import PaddedBatch, PaddedMicroBatch
from megatron_packing.padded.components import build_padded_components

PAD = 7  # a real token id, so a padding column is a token the model could be trained on
DP, B, STEPS = 4, 48, 3


class Chats:
    """Seeded SFT examples: lengths 2..300, about half of the targets trained."""

    def __init__(self, count: int = DP * B, seed: int = 5) -> None:
        rng = np.random.default_rng(seed)
        self.lengths = rng.integers(2, 301, size=count).astype(np.int32)
        self._ids = [rng.integers(10, 1000, size=int(n)) for n in self.lengths]
        self._masks = [(rng.random(int(n)) < 0.5).astype(np.uint8) for n in self.lengths]
        for mask in self._masks:
            mask[-1] = 1  # every example trains its last token
        self.loss_token_counts = np.array([int(m[1:].sum()) for m in self._masks])

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {"input_ids": self._ids[index].copy(), "loss_mask": self._masks[index].copy()}


DATA = Chats()


def steps_of_every_rank(config: PackingConfig) -> list[list[PackedBatch | PaddedBatch]]:
    """The first `STEPS` steps, each as every DP rank's batch, as the loader collates them."""
    build = build_packed_components if config.use_sequence_packing else build_padded_components
    ranks = []
    for rank in range(DP):
        sampler, planned, collate = build(DATA, config, dp_rank=rank, dp_size=DP, seed=3)
        ranks.append([collate(planned.__getitems__(plan)) for plan in islice(sampler, STEPS)])
    return [list(step) for step in zip(*ranks, strict=True)]


def loss_tokens(rows: list[PackedMicroBatch | PaddedMicroBatch]) -> int:
    return int(sum(float(row.loss_mask.sum()) for row in rows))


@pytest.fixture(scope="module")
def padded_steps() -> list[list[PaddedBatch]]:
    config = PackingConfig(use_sequence_packing=False, global_batch_size=B,
                           max_tokens_per_microbatch=900, pad_token_id=PAD)
    return steps_of_every_rank(config)  # type: ignore[return-value]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_padded_rows_train_the_steps_loss_tokens_and_no_padding(padded_steps, tp):
    widened = dummies = 0
    for step in padded_steps:
        count = step[0].meta.num_loss_tokens
        trained = 0
        for batch in step:
            rows, seq_length = step_rows(batch, pipeline=False, pad_token_id=PAD,
                                         width_multiple=tp)
            assert len(rows) == batch.meta.micro_batches_per_rank
            for block, planned in zip(rows, batch.micro_batches, strict=True):
                assert isinstance(block, PaddedMicroBatch)
                width = int(block.tokens.shape[1])
                assert width % tp == 0 and width <= seq_length
                if planned is None:  # a dummy: one row, as wide as the TP size, no loss
                    dummies += 1
                    assert block.tokens.shape == (1, tp) and block.example_indices == ()
                    assert float(block.loss_mask.sum()) == 0
                    continue
                widened += width != planned.tokens.shape[1]
                for row, length in enumerate(block.lengths.tolist()):
                    # a row's targets are its next tokens: none past its last real token
                    assert float(block.loss_mask[row, length - 1:].sum()) == 0
                    assert not block.attention_mask[row, length:].any()
                    assert (block.tokens[row, length:] == PAD).all()
            trained += loss_tokens(rows)
        assert trained == count, f"step {step[0].meta.step}: rows train {trained}, plan {count}"
    assert dummies, "some rank must run short (dummies) for the test to mean anything"
    if tp > 1:
        assert widened, "some block must be widened to the TP size"


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda tp: f"tp{tp}")
def packed_steps(request) -> tuple[int, list[list[PackedBatch]]]:
    tp = request.param
    config = PackingConfig(global_batch_size=B, bin_capacity=512, tp_size=tp,
                           align_packing_bins_to_dp=True,
                           packing_batch_size_allowed_variation=0.2, pad_token_id=PAD)
    return tp, steps_of_every_rank(config)  # type: ignore[return-value]


@pytest.mark.parametrize("pipeline", [False, True], ids=["no-pp", "pp"])
def test_packed_rows_train_the_steps_loss_tokens_and_no_padding(packed_steps, pipeline):
    tp, steps = packed_steps
    grown = 0
    for step in steps:
        count = step[0].meta.num_loss_tokens
        trained = 0
        for batch in step:
            rows, seq_length = step_rows(batch, pipeline=pipeline, pad_token_id=PAD)
            for row, planned in zip(rows, batch.micro_batches, strict=True):
                assert isinstance(row, PackedMicroBatch)
                length = int(row.tokens.shape[1])
                assert length % tp == 0
                assert length == (seq_length if pipeline else planned.tokens.shape[1])
                grown += length != planned.tokens.shape[1]
                real, padded = row.cu_seqlens.tolist(), row.cu_seqlens_padded.tolist()
                assert padded[-1] == length
                for start, end, n in zip(padded, padded[1:],
                                         np.diff(real).tolist(), strict=False):
                    # a sequence's targets end at its last real token; its padding has none
                    assert float(row.loss_mask[0, start + max(n - 1, 0):end].sum()) == 0
            trained += loss_tokens(rows)
        assert trained == count, f"step {step[0].meta.step}: rows train {trained}, plan {count}"
    if pipeline:
        assert grown, "some row must be padded to the step's longest for the test to mean anything"


def test_a_dummy_carries_no_label_to_train_at_any_width():
    """The dummy of a rank that runs short, as wide as sequence parallelism needs."""
    step = PaddedBatch(micro_batches=[None], meta=None)  # type: ignore[arg-type]
    for tp in (1, 2, 4, 8):
        (dummy,), _ = step_rows(step, pipeline=False, pad_token_id=PAD, width_multiple=tp)
        assert isinstance(dummy, PaddedMicroBatch)
        assert dummy.tokens.shape == (1, tp)
        assert torch.count_nonzero(dummy.loss_mask) == 0
