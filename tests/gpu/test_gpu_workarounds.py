"""Where CUDA exists, `megatron_packing.megatron.cpu_workarounds` stands down: it patches nothing,
and inside its modes tensors that name CUDA land there with their own CUDA types (the CPU tier
runs every workaround; this is their GPU branch)."""

from __future__ import annotations

import torch
from gpu_runs import TIER

pytestmark = TIER


def test_the_cpu_workarounds_change_nothing_where_cuda_exists():
    from megatron_packing.megatron import cpu_workarounds

    cuda = torch.cuda
    before = (cuda.current_device, cuda.synchronize, cuda.current_stream)
    assert not cpu_workarounds.cpu_only()
    cpu_workarounds.apply_cpu_workarounds()
    assert (cuda.current_device, cuda.synchronize, cuda.current_stream) == before
    assert isinstance(cuda.current_device(), int)
    with cpu_workarounds.megatron_optimizer_compat(), cpu_workarounds.cuda_factories_on_cpu():
        made = torch.zeros(3, device="cuda")
        assert made.device.type == "cuda"
        assert made.type() == "torch.cuda.FloatTensor"
        assert made.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        wide = torch.zeros(2, dtype=torch.float64, device="cuda")
        assert wide.type() == "torch.cuda.DoubleTensor"
        assert wide.float().dtype == torch.float32
