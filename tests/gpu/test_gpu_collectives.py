"""The library's NCCL branches, through their public callers, on an NCCL group of world size 1.

NCCL moves CUDA tensors only: a collective given a CPU tensor fails. So each call below fails
if the library put its wire tensors anywhere but the current CUDA device
(`padded.sync._collective_device`, `megatron.lm_batch._wire_device`); and THD boundaries built
with no device given must land there too (`megatron.packed_seq.default_device`). The CPU tier
runs the same callers on gloo.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gpu_runs import TIER

pytestmark = TIER


def _lm_batch(with_mask: bool) -> dict[str, torch.Tensor]:
    """Two sequences (3 and 4 tokens, the second aligned to 5) in one row of 8, on the CPU."""
    total = 8
    batch = {
        "tokens": torch.arange(100, 100 + total, dtype=torch.int64)[None],
        "labels": torch.arange(200, 200 + total, dtype=torch.int64)[None],
        "loss_mask": torch.tensor([[1, 1, 0, 1, 1, 1, 0, 0]], dtype=torch.float32),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]], dtype=torch.int64),
        "cu_seqlens": torch.tensor([[0, 3, 7]], dtype=torch.int32),
        "cu_seqlens_padded": torch.tensor([[0, 3, 8]], dtype=torch.int32),
        "max_seqlen": torch.tensor([5], dtype=torch.int32),
    }
    if with_mask:
        from megatron_packing.megatron.packed_seq import block_diagonal_causal_mask

        batch["attention_mask"] = block_diagonal_causal_mask(batch["cu_seqlens_padded"][0], total)
    return batch


def test_align_microbatch_count_all_reduces_on_the_cuda_device_over_nccl(nccl_world):
    from megatron_packing import align_microbatch_count

    group = dist.new_group([0], backend="nccl")
    assert dist.get_backend(group) == dist.get_backend() == "nccl"
    schedule = ["mb0", "mb1", "mb2"]
    assert align_microbatch_count(schedule, group) == schedule
    assert align_microbatch_count(schedule) == schedule  # the default (NCCL) group
    assert align_microbatch_count([], group) == []


@pytest.mark.parametrize("with_mask", [False, True])
def test_broadcast_batch_across_tp_sends_cuda_tensors_over_nccl(nccl_world, with_mask):
    from megatron.core import parallel_state

    from megatron_packing.megatron.lm_batch import LM_BATCH_KEYS, broadcast_batch_across_tp

    sent = _lm_batch(with_mask)
    group = dist.new_group([0], backend="nccl")
    tp_group = parallel_state.get_tensor_model_parallel_group()
    assert dist.get_backend(tp_group) == "nccl"
    for got in (broadcast_batch_across_tp(sent, group=group, src_rank=0),
                broadcast_batch_across_tp(sent)):  # megatron-core's TP group and source
        assert list(got) == list(LM_BATCH_KEYS)
        for key in LM_BATCH_KEYS:
            if key == "attention_mask" and not with_mask:
                assert got[key] is None
                continue
            value = got[key]
            assert value is not None
            assert value.device == torch.device("cuda", torch.cuda.current_device()), key
            assert value.dtype == sent[key].dtype, key
            assert torch.equal(value.cpu(), sent[key].reshape(value.shape)), key


def test_packed_seq_params_put_the_boundaries_on_the_current_cuda_device(nccl_world):
    from megatron_packing.megatron.packed_seq import packed_seq_params

    batch = _lm_batch(with_mask=False)
    params = packed_seq_params(batch)  # no device: the current CUDA device
    here = torch.device("cuda", torch.cuda.current_device())
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        tensor = getattr(params, name)
        assert tensor.device == here and tensor.dtype == torch.int32, name
    assert params.cu_seqlens_q.tolist() == [0, 3, 7]
    assert params.cu_seqlens_q_padded.tolist() == [0, 3, 8]
    assert params.max_seqlen_q == params.max_seqlen_kv == 5
