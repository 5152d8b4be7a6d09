"""megatron-core's ``dist_checkpointing`` (torch_dist, Megatron's default format) on the GPU, in
this process: a bf16 GPT's sharded state dict saved from CUDA and loaded into another GPT on
CUDA gives back every tensor bit for bit. The entry point's kill -9 and ``--load`` run writes the
same format (`test_gpu_entry_point.py`)."""

from __future__ import annotations

import torch
from gpu_runs import TIER

pytestmark = TIER


def _gpt(seed: int):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                               ffn_hidden_size=256, bf16=True, params_dtype=torch.bfloat16,
                               hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=512,
                     max_sequence_length=128, position_embedding_type="learned_absolute")
    return model.cuda().bfloat16()  # as Megatron's Float16Module casts it


def _tensors(model) -> dict[str, torch.Tensor]:
    return {key: value for key, value in model.state_dict().items()
            if isinstance(value, torch.Tensor)}


def test_a_gpt_saved_with_torch_dist_on_cuda_loads_back_bit_for_bit(nccl_world, tmp_path):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import maybe_load_config

    saved = _gpt(seed=1)
    dist_checkpointing.save(saved.sharded_state_dict(), str(tmp_path))
    config = maybe_load_config(str(tmp_path))
    assert config is not None and config.sharded_backend == "torch_dist"

    loaded = _gpt(seed=2)
    want, before = _tensors(saved), _tensors(loaded)
    assert set(before) == set(want) and len(want) >= 10
    assert any(not torch.equal(before[key], want[key]) for key in want), "seeds must differ"
    loaded.load_state_dict(dist_checkpointing.load(loaded.sharded_state_dict(), str(tmp_path)))
    got = _tensors(loaded)
    for key, tensor in want.items():
        assert got[key].device.type == "cuda", key
        assert got[key].dtype == tensor.dtype, key
        assert torch.equal(got[key], tensor), key
    assert any(tensor.dtype == torch.bfloat16 for tensor in got.values())
