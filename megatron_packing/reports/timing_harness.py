"""Timing one transformer layer's forward + backward on packed micro-batches (for ``calibrate``).

One Llama-like layer of the user's shape: RMSNorm, fused QKV projection, causal attention over
the row's sequences (block-diagonal: each sequence attends only to itself), output projection,
RMSNorm, SwiGLU MLP, residuals; no bias, no dropout, no rotary embedding (elementwise, a
negligible share). The attention, the part whose cost the fit must see:

- megatron-core's own ``TransformerLayer`` with Transformer Engine and THD packed sequences,
  where ``transformer_engine`` imports (a CUDA device only; the whole layer is megatron-core's);
- else torch's variable-length flash attention, ``torch.nn.attention.varlen.varlen_attn``, on a
  CUDA device where torch has it;
- else ``torch.nn.functional.scaled_dot_product_attention``, causal, one sequence at a time (the
  CPU path, for tests: CPU timings do not predict a GPU's).

Each composition runs ``warmup`` times untimed, then ``repeats`` times; its time is the median,
the device synchronised around every run. A time limit (counted from the layer's
build) stops the timing after the composition during which it passed.
"""

from __future__ import annotations

import inspect
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from megatron_packing.packing.cost_fit import Measured

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""The dtypes a layer can be timed in, by the name ``--dtype`` takes."""


@dataclass(frozen=True)
class LayerShape:
    """The layer to time: hidden size, attention heads, MLP (FFN) hidden size and dtype name."""

    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    dtype: str

    def describe(self) -> str:
        return (f"hidden {self.hidden_size}, {self.num_attention_heads} heads, FFN "
                f"{self.ffn_hidden_size}, {self.dtype}")


@dataclass
class Timings:
    """What the harness measured, with what, on which device, and whether a limit cut it short."""

    measured: list[Measured]
    backend: str
    device: str
    notes: list[str] = field(default_factory=list)
    stopped_early: bool = False
    seconds: float = 0.0


Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, list[int]],
                     torch.Tensor]


def _per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                  longest: int, lengths: list[int]) -> torch.Tensor:
    """Causal SDPA one sequence at a time; q, k, v are (tokens, heads, head dim)."""
    out, start = [], 0
    for length in lengths:
        span = slice(start, start + length)
        query, key, value = (x[span].transpose(0, 1) for x in (q, k, v))  # (heads, length, dim)
        out.append(F.scaled_dot_product_attention(query, key, value, is_causal=True)
                   .transpose(0, 1))
        start += length
    return torch.cat(out)


def _varlen() -> Attention | None:
    """torch's variable-length flash attention, causal, where this torch has it."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    function = getattr(varlen, "varlen_attn", None)
    if function is None:
        return None
    parameters = inspect.signature(function).parameters
    if "window_size" in parameters:  # newer torch: causal is a (-1, 0) window
        causal: dict[str, Any] = {"window_size": (-1, 0)}
    elif "is_causal" in parameters:
        causal = {"is_causal": True}
    else:
        return None

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
               longest: int, lengths: list[int]) -> torch.Tensor:
        q, k, v = (x.contiguous() for x in (q, k, v))  # views of the fused QKV projection
        result = function(q, k, v, cu, cu, longest, longest, **causal)
        return result[0] if isinstance(result, tuple) else result

    return attend


class TorchLayer(torch.nn.Module):
    """The Llama-like layer of the module docstring, on a given attention."""

    def __init__(self, shape: LayerShape, attention: Attention) -> None:
        super().__init__()
        h, f = shape.hidden_size, shape.ffn_hidden_size
        self.heads = shape.num_attention_heads
        self.attention = attention
        self.norm1 = torch.nn.RMSNorm(h)
        self.qkv = torch.nn.Linear(h, 3 * h, bias=False)
        self.proj = torch.nn.Linear(h, h, bias=False)
        self.norm2 = torch.nn.RMSNorm(h)
        self.gate_up = torch.nn.Linear(h, 2 * f, bias=False)
        self.down = torch.nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor, cu: torch.Tensor, longest: int,
                lengths: list[int]) -> torch.Tensor:
        tokens, hidden = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(tokens, 3, self.heads, -1).unbind(1)
        x = x + self.proj(self.attention(q, k, v, cu, longest, lengths).reshape(tokens, hidden))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def _megatron_layer(shape: LayerShape, device: torch.device) -> Callable[..., torch.Tensor]:
    """megatron-core's TransformerLayer with Transformer Engine, run on THD packed rows."""
    import transformer_engine  # type: ignore[import-not-found]  # noqa: F401
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not torch.distributed.is_initialized():
        store = Path(tempfile.mkdtemp(prefix="calibrate_")) / "store"
        torch.distributed.init_process_group("nccl", init_method=f"file://{store}",
                                             rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    dtype = DTYPES[shape.dtype]
    config = TransformerConfig(
        num_layers=1, hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads, ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype)
    layer = build_module(get_gpt_layer_with_transformer_engine_spec(), config=config,
                         layer_number=1).to(device)

    def run(x: torch.Tensor, cu: torch.Tensor, longest: int, lengths: list[int]) -> torch.Tensor:
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                                 max_seqlen_q=longest, max_seqlen_kv=longest)
        out = layer(hidden_states=x.unsqueeze(1), attention_mask=None, packed_seq_params=params)
        return (out[0] if isinstance(out, tuple) else out).squeeze(1)

    return run


def build_layer(shape: LayerShape, device: torch.device) -> tuple[Callable[..., torch.Tensor], str, list[str]]:
    """The layer to time on ``device``, what it is, and notes (a path that could not be used)."""
    notes: list[str] = []
    if device.type == "cuda":
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            notes.append("Transformer Engine does not import: torch's own attention is timed")
        else:
            try:
                return (_megatron_layer(shape, device),
                        "megatron-core TransformerLayer, Transformer Engine, THD", notes)
            except Exception as exc:  # any failure to build it: time torch's layer, and say so
                notes.append(f"megatron-core's Transformer Engine layer could not be built "
                             f"({type(exc).__name__}: {exc}); torch's own attention is timed")
        attend = _varlen()
        if attend is not None:
            layer = TorchLayer(shape, attend).to(device=device, dtype=DTYPES[shape.dtype])
            return layer, "torch layer, torch.nn.attention.varlen.varlen_attn (flash)", notes
        notes.append("torch.nn.attention.varlen.varlen_attn is missing from this torch: "
                     "scaled_dot_product_attention per sequence is timed")
    layer = TorchLayer(shape, _per_sequence).to(device=device, dtype=DTYPES[shape.dtype])
    return layer, "torch layer, scaled_dot_product_attention per sequence", notes


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(layer: Callable[..., torch.Tensor], lengths: Sequence[int], hidden: int,
              dtype: torch.dtype, device: torch.device, repeats: int, warmup: int) -> float:
    """Median ms of forward + backward of one packed row of ``lengths``."""
    tokens = int(sum(lengths))
    x = torch.randn(tokens, hidden, dtype=dtype, device=device, requires_grad=True)
    grad = torch.randn(tokens, hidden, dtype=dtype, device=device)
    cu_list = [0]
    for length in lengths:
        cu_list.append(cu_list[-1] + int(length))
    cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
    longest = int(max(lengths))
    lengths = [int(s) for s in lengths]
    times = []
    for run in range(warmup + repeats):
        _synchronize(device)
        started = time.perf_counter()
        layer(x, cu, longest, lengths).backward(grad)
        _synchronize(device)
        if run >= warmup:
            times.append((time.perf_counter() - started) * 1e3)
        x.grad = None
    return float(statistics.median(times))


def time_layer(shape: LayerShape, compositions: Sequence[Sequence[int]], *, device: str,
               repeats: int, warmup: int = 2, time_limit_s: float | None = None,
               report: Callable[[Measured], None] | None = None) -> Timings:
    """Time every composition in order (or until ``time_limit_s`` has passed)."""
    target = torch.device(device)
    threads = torch.get_num_threads()
    if target.type == "cpu":
        torch.set_num_threads(1)  # one thread: other threads' contention is most of the noise
    try:
        return _time_layer(shape, compositions, target, repeats, warmup, time_limit_s, report)
    finally:
        torch.set_num_threads(threads)


def _time_layer(shape: LayerShape, compositions: Sequence[Sequence[int]], target: torch.device,
                repeats: int, warmup: int, time_limit_s: float | None,
                report: Callable[[Measured], None] | None) -> Timings:
    started = time.perf_counter()
    torch.manual_seed(1234)
    layer, backend, notes = build_layer(shape, target)
    name = (f"{target} ({torch.cuda.get_device_name(target)})" if target.type == "cuda"
            else str(target))
    timings = Timings([], backend, name, notes)
    dtype = DTYPES[shape.dtype]
    for number, lengths in enumerate(compositions, start=1):
        ms = time_once(layer, lengths, shape.hidden_size, dtype, target, repeats, warmup)
        timings.measured.append(Measured(tuple(int(s) for s in lengths), ms))
        if report is not None:
            report(timings.measured[-1])
        over = time_limit_s is not None and time.perf_counter() - started > time_limit_s
        if over and number < len(compositions):
            timings.stopped_early = True
            break
    timings.seconds = time.perf_counter() - started
    return timings
