"""Packed rows (block-diagonal mask, restarting positions) train exactly like one row each."""

from __future__ import annotations

import json

import pytest
import torch
from packing_helpers import pack_row

from megatron_packing.megatron.packed_seq import (
    block_diagonal_causal_mask,
    packed_seq_params,
    restarting_position_ids,
)


def test_block_diagonal_mask_and_positions():
    row = pack_row([[5, 6, 7], [8, 9]], seq_multiple=2)  # segments [0, 4) and [4, 6)
    mask = block_diagonal_causal_mask(row.cu_seqlens_padded, 6)[0, 0]
    allowed = ~mask
    assert allowed[2, :3].all() and not allowed[2, 3:].any()
    assert allowed[5, 4:].all() and not allowed[5, :4].any()
    assert not allowed[4, 5]  # causal inside a segment
    assert torch.equal(restarting_position_ids(row.cu_seqlens_padded, 6), row.position_ids)
    assert row.position_ids.tolist() == [[0, 1, 2, 3, 0, 1]]


def test_thd_packed_seq_params_fields():
    row = pack_row([[5, 6, 7], [8, 9], [1, 2, 3, 4, 5]], seq_multiple=4)
    params = packed_seq_params(row)
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == [0, 3, 5, 10]
    assert params.cu_seqlens_kv.tolist() == [0, 3, 5, 10]
    assert params.cu_seqlens_q_padded.tolist() == [0, 4, 8, 16]
    assert params.cu_seqlens_kv_padded.tolist() == [0, 4, 8, 16]
    assert params.cu_seqlens_q.dtype == torch.int32
    assert params.max_seqlen_q == params.max_seqlen_kv == 8
    assert row.tokens.shape == (1, 16)


def test_thd_packed_seq_params_row_fields_as_this_megatron_core_has_them():
    """megatron-core 0.19's row-level fields are filled when its PackedSeqParams has them;
    0.16's PackedSeqParams is built with its own fields only."""
    from megatron_packing.megatron.compat import packed_seq_params_fields

    row = pack_row([[5, 6, 7], [8, 9], [1, 2, 3, 4, 5]], seq_multiple=4)
    params = packed_seq_params(row, "cpu")
    if "total_tokens" not in packed_seq_params_fields():  # megatron-core 0.16
        assert not hasattr(params, "total_tokens")
        return
    assert params.total_tokens == 16  # the row's length, the last padded boundary
    assert params.tokens_per_sample == 16  # one row is one sample
    assert params.pad_between_seqs is True  # sequences 0, 1 and 2 carry alignment padding
    # megatron-core derives seq_idx from total_tokens: each token's padded segment.
    assert params.seq_idx.tolist() == [[0] * 4 + [1] * 4 + [2] * 8]
    unpadded = pack_row([[5, 6, 7, 8], [8, 9, 1, 2]], seq_multiple=4)
    params = packed_seq_params(unpadded, "cpu")
    assert params.pad_between_seqs is False
    assert params.total_tokens == params.tokens_per_sample == 8
    assert params.seq_idx.tolist() == [[0] * 4 + [1] * 4]


@pytest.mark.slow
def test_packed_equals_unpacked_dp2(tmp_path):
    from dp_workers import STEP_SIZES, packed_vs_unpacked

    from megatron_packing.demo.launch import spawn_data_parallel

    spawn_data_parallel(packed_vs_unpacked, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert len(ranks[0]) == len(STEP_SIZES)
    assert {r["micro_batches"] for r in ranks[0]} != {ranks[0][0]["micro_batches"]}  # varies
    assert any(r["placeholders"] for rank in ranks for r in rank)
    for rank in ranks:
        for rec in rank:
            assert rec["loss_packed"] == pytest.approx(rec["loss_ref"], rel=1e-9)
            assert rec["loss_unpacked"] == pytest.approx(rec["loss_ref"], rel=1e-9)
            assert rec["grad_rel_packed_unpacked"] <= 1e-6
            assert rec["grad_rel_packed_ref"] <= 1e-6
            assert rec["grad_norm"] > 0
    for a, b in zip(ranks[0], ranks[1], strict=True):
        assert a["loss_packed"] == b["loss_packed"]


@pytest.mark.slow
def test_a_plain_batch_sampler_and_the_collator_packing_on_its_own_train_dp2(tmp_path):
    """No packing sampler at all: torch's BatchSampler gives each rank the global batch and the
    collator packs it, keeping the rank's bins. Every step's loss and gradient equal the
    single-process reference over the step's examples, and the loss falls over three epochs."""
    from dp_workers import plain_batch_sampler_training

    from megatron_packing.demo.launch import spawn_data_parallel

    spawn_data_parallel(plain_batch_sampler_training, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for mine, theirs in zip(*ranks, strict=True):
        assert mine["micro_batches"] == theirs["micro_batches"]  # equal counts: no hang
        assert mine["bins"] % 2 == 0
        assert not set(mine["examples"]) & set(theirs["examples"])
    for rank in ranks:
        for rec in rank:
            assert rec["loss"] == pytest.approx(rec["loss_ref"], rel=1e-9)
            assert rec["grad_rel"] <= 1e-6
    first, last = ranks[0][:5], ranks[0][-5:]
    assert sum(r["loss"] for r in last) < sum(r["loss"] for r in first)
