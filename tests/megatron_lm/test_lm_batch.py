"""Batch formats for Megatron-LM and Megatron-Bridge, the TP broadcast and THD CP slicing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lm_rows import pack_row, random_rows
from megatron_lm_runs import requires_megatron_lm

from megatron_packing.megatron.lm_batch import (
    LM_BATCH_KEYS,
    LM_ITERATOR_KEYS,
    batch_for_cp_rank,
    broadcast_batch_across_tp,
    cp_partition_indices,
    merge_cp_slices,
    to_bridge_packed_batch,
    to_megatron_lm_batch,
)
from megatron_packing.megatron.packed_seq import packed_seq_params


def _padded_row():
    """Three sequences padded to multiples of 4: real [0, 3, 5, 10], padded [0, 4, 8, 16]."""
    return pack_row([[5, 6, 7], [8, 9], [1, 2, 3, 4, 5]], seq_multiple=4)


@pytest.fixture(scope="module")
def solo_group():
    """A one-rank gloo group: its rank is its own TP source."""
    import torch.distributed as dist

    from megatron_packing.demo.launch import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        yield dist.new_group([0])
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- Megatron-LM dict

def test_megatron_lm_batch_keys_dtypes_shapes():
    row = _padded_row()
    batch = to_megatron_lm_batch(row)
    assert tuple(batch) == LM_ITERATOR_KEYS
    assert "attention_mask" not in batch  # Megatron-LM's TP step would call None.cuda()
    for key, dtype in (("tokens", torch.int64), ("labels", torch.int64),
                       ("loss_mask", torch.float32), ("position_ids", torch.int64)):
        assert batch[key].dtype == dtype and batch[key].shape == (1, 16), key
        assert torch.equal(batch[key], getattr(row, key).to(dtype))
    assert batch["cu_seqlens"].dtype == batch["cu_seqlens_padded"].dtype == torch.int32
    assert batch["cu_seqlens"].tolist() == [[0, 3, 5, 10]]
    assert batch["cu_seqlens_padded"].tolist() == [[0, 4, 8, 16]]
    assert batch["max_seqlen"].dtype == torch.int32
    assert batch["max_seqlen"].shape == (1,) and batch["max_seqlen"].tolist() == [8]


def test_megatron_lm_batch_through_megatron_thd_path(solo_group):
    """Our TP step, then what ``pretrain_gpt.get_batch`` does next, with megatron-core's function.

    Replays pretrain_gpt.py (core_v0.16.1) lines 80-97: pop the THD keys, assert
    ``max_seqlen.dim() == 1``, call ``get_thd_batch_on_this_cp_rank`` (cp = 1 runs on CPU) and
    unpack ``(*batch.values(), packed_seq_params)`` as forward_step does.
    """
    from megatron_packing.megatron.compat import thd_cp_slicer

    get_thd_batch_on_this_cp_rank = thd_cp_slicer()
    if get_thd_batch_on_this_cp_rank is None:
        pytest.skip("megatron-core 0.19 has no get_thd_batch_on_this_cp_rank (core_v0.16.1's "
                    "pretrain_gpt path); 0.19's PackedSeqParams: tests/megatron/"
                    "test_packed_equivalence.py")
    row = _padded_row()
    batch = broadcast_batch_across_tp(to_megatron_lm_batch(row), group=solo_group)
    cu_seqlens = batch.pop("cu_seqlens", None)
    cu_seqlens_padded = batch.pop("cu_seqlens_padded", None)
    max_seqlen = batch.pop("max_seqlen", None)
    assert batch.pop("local_cp_size", None) is None
    assert cu_seqlens is not None  # selects the packed THD branch
    assert max_seqlen.dim() == 1
    batch, params = get_thd_batch_on_this_cp_rank(batch, cu_seqlens, cu_seqlens_padded,
                                                  max_seqlen, cp_size=1, cp_rank=0)
    tokens, labels, loss_mask, attention_mask, position_ids, packed = (*batch.values(), params)
    assert torch.equal(tokens, row.tokens) and torch.equal(labels, row.labels)
    assert torch.equal(loss_mask, row.loss_mask) and torch.equal(position_ids, row.position_ids)
    assert attention_mask is None
    assert packed.qkv_format == "thd"
    assert packed.max_seqlen_q == packed.max_seqlen_kv == 8
    assert packed.cu_seqlens_q.reshape(-1).tolist() == [0, 3, 5, 10]
    assert packed.cu_seqlens_q_padded.reshape(-1).tolist() == [0, 4, 8, 16]


def test_megatron_lm_batch_rejects_boundaries_that_miss_the_row():
    row = _padded_row()
    row.cu_seqlens_padded = torch.tensor([0, 4, 8, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_padded ends at 12, the row holds 16"):
        to_megatron_lm_batch(row)


# ----------------------------------------------------------------------------- TP broadcast

@pytest.fixture(scope="module")
def tp_run(tmp_path_factory) -> Path:
    """One 2-rank TP group (gloo) runs our broadcast, then Megatron-LM's own when available."""
    from tp_workers import broadcast_rows_then_megatron, spawn_tensor_parallel

    out = tmp_path_factory.mktemp("tp")
    spawn_tensor_parallel(broadcast_rows_then_megatron, 2, str(out))
    return out


@pytest.mark.slow
def test_tp_broadcast_keeps_padded_boundaries(tp_run):
    from tp_workers import NUM_ROWS, ROWS_SEED

    expected = [to_megatron_lm_batch(r) for r in random_rows(NUM_ROWS, seed=ROWS_SEED)]
    lengths = {b["tokens"].shape[1] for b in expected}
    counts = {b["cu_seqlens"].numel() for b in expected}
    assert len(lengths) > 1 and len(counts) > 1, "rows must vary in length and sequence count"
    assert any(not torch.equal(b["cu_seqlens"], b["cu_seqlens_padded"]) for b in expected)
    for rank in (0, 1):
        got = torch.load(Path(tp_run, f"rank{rank}.pt"))
        assert len(got) == NUM_ROWS
        for want, have in zip(expected, got, strict=True):
            assert tuple(have) == LM_BATCH_KEYS
            assert have["attention_mask"] is None
            for key in LM_BATCH_KEYS:
                if key == "attention_mask":
                    continue
                assert have[key].dtype == want[key].dtype, (rank, key)
                assert torch.equal(have[key], want[key]), (rank, key)


@pytest.mark.slow
@requires_megatron_lm
def test_megatron_lm_tp_broadcast_drops_padded_boundaries(tp_run):
    """Megatron-LM's ``get_batch_on_this_tp_rank`` (core_v0.16.1) run on 2 gloo ranks."""
    from tp_workers import MEGATRON_TP_FILE, NUM_ROWS, ROWS_SEED

    if not Path(tp_run, MEGATRON_TP_FILE.format(0)).is_file():
        pytest.skip("this Megatron-LM has no megatron.training.utils.get_batch_on_this_tp_rank "
                    "(core_v0.16.1's; megatron-core 0.19 moved it)")
    row = random_rows(NUM_ROWS, seed=ROWS_SEED)[0]
    assert not torch.equal(row.cu_seqlens, row.cu_seqlens_padded)
    for rank in (0, 1):
        got = torch.load(Path(tp_run, MEGATRON_TP_FILE.format(rank)))
        assert torch.equal(got["tokens"], row.tokens), rank
        assert torch.equal(got["cu_seqlens"].reshape(-1), row.cu_seqlens), rank
        # The padded boundaries are gone on every rank, so get_batch would pass
        # cu_seqlens_padded=None on to THD attention and CP slicing.
        assert "cu_seqlens_padded" not in got, rank


def test_tp_broadcast_checks_the_source_batch(solo_group):
    with pytest.raises(ValueError, match="TP source and must pass a batch"):
        broadcast_batch_across_tp(None, group=solo_group)
    batch = to_megatron_lm_batch(_padded_row())
    batch["loss_mask"] = batch["loss_mask"].double()
    with pytest.raises(ValueError, match="loss_mask.*expected torch.float32"):
        broadcast_batch_across_tp(batch, group=solo_group)
    batch = to_megatron_lm_batch(_padded_row())
    batch["num_loss_tokens"] = torch.tensor(7)
    with pytest.raises(ValueError, match="num_loss_tokens"):
        broadcast_batch_across_tp(batch, group=solo_group)
    # A group of one is its own source: the batch comes back whole, in get_batch's layout.
    same = broadcast_batch_across_tp(to_megatron_lm_batch(_padded_row()), group=solo_group)
    assert tuple(same) == LM_BATCH_KEYS and same["attention_mask"] is None
    assert same["cu_seqlens_padded"].tolist() == [[0, 4, 8, 16]]


# ----------------------------------------------------------------------------- CP partitioning

def _reference_indices(lengths: list[int], cp_size: int, cp_rank: int) -> list[int]:
    """Written from the description: 2*cp equal chunks per sequence, rank r takes r and 2cp-1-r."""
    out, start = [], 0
    for length in lengths:
        chunk = length // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            out.extend(range(start + c * chunk, start + (c + 1) * chunk))
        start += length
    return out


def test_cp_indices_hand_worked_cp2():
    # Sequence 0 holds positions 0-7 (chunks of 2), sequence 1 positions 8-11 (chunks of 1).
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    assert cp_partition_indices(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert cp_partition_indices(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    assert cp_partition_indices(cu, 1, 0).tolist() == list(range(12))
    assert cp_partition_indices(cu, 2, 0).dtype == torch.int64


@settings(max_examples=60, deadline=None)
@given(cp_size=st.integers(1, 4), data=st.data())
def test_cp_indices_cover_each_position_once(cp_size, data):
    multiples = data.draw(st.lists(st.integers(0, 6), min_size=1, max_size=8))
    lengths = [m * 2 * cp_size for m in multiples]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    per_rank = [cp_partition_indices(cu, cp_size, r) for r in range(cp_size)]
    assert all(p.numel() == total // cp_size for p in per_rank)
    union = torch.cat(per_rank)
    assert torch.equal(union.sort().values, torch.arange(total))
    for r, got in enumerate(per_rank):
        assert got.tolist() == _reference_indices(lengths, cp_size, r)


def test_cp_indices_reject_lengths_not_divisible_by_2cp():
    cu = torch.tensor([0, 8, 14], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"padded sequence 1 has length 6.*2 \* cp_size = 4"):
        cp_partition_indices(cu, 2, 0)
    with pytest.raises(ValueError, match="cp_rank=2"):
        cp_partition_indices(torch.tensor([0, 8]), 2, 2)


def test_cp_slices_split_loss_tokens_and_merge_back():
    cp = 2
    rows = random_rows(5, seed=3, seq_multiple=2 * cp)
    for row in rows:
        batch = to_megatron_lm_batch(row)
        shares = [batch_for_cp_rank(batch, cp, r) for r in range(cp)]
        total = batch["tokens"].shape[1]
        for share in shares:
            assert share["tokens"].shape == (1, total // cp)
            # Boundaries describe the full row on every rank, as TE expects.
            assert share["cu_seqlens"] is batch["cu_seqlens"]
            assert share["cu_seqlens_padded"] is batch["cu_seqlens_padded"]
            assert share["max_seqlen"] is batch["max_seqlen"]
        assert sum(float(s["loss_mask"].sum()) for s in shares) == float(batch["loss_mask"].sum())
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            merged = merge_cp_slices([s[key] for s in shares], batch["cu_seqlens_padded"])
            assert torch.equal(merged, batch[key]), key


def test_cp_slicing_rejects_rows_longer_than_their_boundaries():
    batch = to_megatron_lm_batch(_padded_row())
    batch["cu_seqlens_padded"] = torch.tensor([[0, 4, 8, 12]], dtype=torch.int32)
    with pytest.raises(ValueError, match="ends at 12 but the row holds 16"):
        batch_for_cp_rank(batch, 2, 0)


# ----------------------------------------------------------------------------- Megatron-Bridge

def _bridge_params_oracle(batch: dict, *, use_argmin_keys: bool) -> dict:
    """Bridge's legacy ``get_packed_seq_params`` semantics, restated independently.

    Squeeze the batch dimension, cut each boundary list at its first -1 (the stored argmin, or
    ``torch.argmin`` when absent); with unpadded boundaries present, q/kv use them and the
    padded ones go to the ``*_padded`` fields; ``max_seqlen`` is squeezed.
    """
    def trim(key: str) -> torch.Tensor:
        values = batch[key].squeeze()
        stop = (int(batch[f"{key}_argmin"].item()) if use_argmin_keys
                else int(torch.argmin(values)))
        return values[:stop]

    padded, real = trim("cu_seqlens"), trim("cu_seqlens_unpadded")
    return {"cu_seqlens_q": real, "cu_seqlens_kv": real, "cu_seqlens_q_padded": padded,
            "cu_seqlens_kv_padded": padded, "max_seqlen": batch["max_seqlen"].squeeze()}


@pytest.mark.parametrize("cu_len", [None, 9])
def test_bridge_batch_matches_bridge_semantics(cu_len):
    row = _padded_row()
    batch = to_bridge_packed_batch(row, cu_len=cu_len)
    width = 5 if cu_len is None else cu_len
    assert batch["cu_seqlens"].shape == batch["cu_seqlens_unpadded"].shape == (1, width)
    assert batch["cu_seqlens"].dtype == batch["cu_seqlens_unpadded"].dtype == torch.int32
    assert batch["cu_seqlens"][0, 4:].tolist() == [-1] * (width - 4)
    assert batch["max_seqlen"].dtype == torch.int32 and batch["max_seqlen"].device.type == "cpu"
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert torch.equal(batch[key], getattr(row, key))
    want = packed_seq_params(row, device="cpu")
    for use_argmin_keys in (True, False):
        got = _bridge_params_oracle(batch, use_argmin_keys=use_argmin_keys)
        for field in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
                      "cu_seqlens_kv_padded"):
            assert torch.equal(got[field], getattr(want, field)), field
        assert int(got["max_seqlen"]) == want.max_seqlen_q == 8


def test_bridge_batch_needs_room_for_a_minus_one():
    with pytest.raises(ValueError, match="cu_len=4 leaves no -1"):
        to_bridge_packed_batch(_padded_row(), cu_len=4)


# ----------------------------------------------------------------------------- PackedSeqParams

def test_packed_seq_params_default_device_and_batch_dict():
    row = _padded_row()
    from_row = packed_seq_params(row)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert from_row.cu_seqlens_q.device.type == expected
    from_dict = packed_seq_params(to_megatron_lm_batch(row))
    for field in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        a, b = getattr(from_row, field), getattr(from_dict, field)
        assert a.dim() == b.dim() == 1 and b.dtype == torch.int32
        assert torch.equal(a, b), field
    assert from_dict.max_seqlen_q == from_dict.max_seqlen_kv == 8
    assert isinstance(from_dict.max_seqlen_q, int)
    with pytest.raises(ValueError, match="no 'max_seqlen'"):
        packed_seq_params({"cu_seqlens": torch.tensor([0, 3])})


def test_packed_seq_params_refuses_a_max_seqlen_that_is_not_a_count():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    assert packed_seq_params({"cu_seqlens": cu, "max_seqlen": np.int64(3)}, "cpu").max_seqlen_q == 3
    bad = [3.5, True, -1, torch.tensor([2.5]), torch.tensor([3, 4])]
    for value in bad:
        with pytest.raises(ValueError, match="max_seqlen"):
            packed_seq_params({"cu_seqlens": cu, "max_seqlen": value}, "cpu")
