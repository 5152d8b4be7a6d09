"""Padded-mode throughput on a megatron-core GPT: fixed micro-batch sizes against token budgets.

The mission's workload: one global batch of 128 examples whose lengths are drawn log-uniform
from 64 to 32,768 tokens (seed 0, the same draw as `bench_token_budget.py`'s first batch), on one
rank. Each setting splits it exactly as the padded sampler does (`split_rank_share`: a budget
sorts the share longest first and cuts it with the balanced splitter; a fixed size chunks it in
input order), and `collate_microbatch` pads every micro-batch into a [b, L] block. Settings:
fixed micro_batch_size 1 and 2, budgets 16K / 32K / 64K / 128K tokens.

The model is a megatron-core `GPTModel` (Transformer Engine layer spec where TE is importable,
the local spec otherwise), RoPE, bf16 on a GPU. Each setting runs 1 warm-up and 3 timed repeats
of the whole batch, forward only (eval, no_grad) and forward+backward (train; per-token loss
summed over real targets, gradients accumulated over the micro-batches as in a step; no
optimizer). Real tokens/s is reported (padding is not counted), as the median and the slowest
repeat, with GPU utilisation (NVML, sampled during the forward+backward repeats), peak memory
(``torch.cuda.max_memory_allocated``; peak RSS on the CPU) and pad efficiency (real tokens over
the sum of b x L). Rows that run out of GPU memory say so and the sweep goes on.

Attention masks: the local spec gets an explicit [b, 1, L, L] mask, causal plus padded keys; with
right padding, real tokens never see padding. TE uses its causal kernel (which, with right
padding, keeps padded tokens away from real ones as well).

GPU sizing (one H200, planned under 6 minutes; see docs/padded_mode.md): the local spec's
attention materialises b x heads x L^2 scores per layer, which dominates both time and memory at
32K tokens, so the model is 4 layers, hidden 1024, 2 heads (head dim 512), FFN 4096, vocab
16,384 (67M parameters), bf16 softmax, core attention recomputed in the backward. A longer run
is cut at ``--time-limit-s``: the rows it did not reach say "skipped".

``--tiny`` runs the same code on the CPU (any GPU hidden), one intra-op thread by default: a
2-layer, hidden-64 model (float32) on 16 examples of 8..512 tokens, the budgets scaled by the same
1/64 (256 / 512 / 1K / 2K); about 30 s on a shared 2-core machine. Without a GPU and without
``--tiny`` it prints one line and exits 0.

Usage: python benchmarks/bench_gpu_throughput.py [--tiny] [--time-limit-s 330] [--seed 0]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import resource
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_packing.padded.sampler import split_rank_share  # noqa: E402

NO_GPU_MESSAGE = ("bench_gpu_throughput: no CUDA GPU found; nothing measured. Run it on a GPU "
                  "machine, or pass --tiny for the small CPU form.")


@dataclass(frozen=True)
class Workload:
    """The examples and the model of one sweep (the full GPU form or the scaled --tiny form)."""

    name: str
    examples: int
    min_len: int
    max_len: int
    budgets: tuple[int, ...]
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    repeats: int = 3
    warmups: int = 1


FULL = Workload("full", examples=128, min_len=64, max_len=32768,
                budgets=(16384, 32768, 65536, 131072),
                layers=4, hidden=1024, heads=2, ffn=4096, vocab=16384)
TINY_SCALE = 64  # --tiny divides the longest length and the budgets by this
TINY = Workload("tiny", examples=16, min_len=8, max_len=FULL.max_len // TINY_SCALE,
                budgets=tuple(b // TINY_SCALE for b in FULL.budgets),
                layers=2, hidden=64, heads=2, ffn=256, vocab=512)


@dataclass(frozen=True)
class Setting:
    label: str
    budget: int | None  # tokens per micro-batch; None: fixed micro_batch_size
    micro_batch_size: int


def settings(workload: Workload) -> list[Setting]:
    out = [Setting("mbs 1", None, 1), Setting("mbs 2", None, 2)]
    return out + [Setting(f"budget {b}", b, 1) for b in workload.budgets]


def draw_lengths(workload: Workload, seed: int) -> np.ndarray:
    """Log-uniform lengths in [min_len, max_len] (fixed seed)."""
    rng = np.random.default_rng(seed)
    low, high = math.log(workload.min_len), math.log(workload.max_len)
    return np.exp(rng.uniform(low, high, workload.examples)).astype(np.int64)


# --------------------------------------------------------------------------- micro-batches
def make_microbatches(lengths: np.ndarray, setting: Setting, vocab: int, seed: int) -> list[Any]:
    """The setting's schedule over the batch (the padded sampler's split), each a padded block.

    Token ids are random (fixed seed); every real position after the first is a training target.
    """
    from megatron_packing.padded.collate import collate_microbatch

    rng = np.random.default_rng(seed)
    examples = [{"input_ids": rng.integers(1, vocab, int(n)), "loss_mask": np.ones(int(n))}
                for n in lengths]
    schedule = split_rank_share(lengths, setting.budget, setting.micro_batch_size)
    return [collate_microbatch([examples[i] for i in group], group) for group in schedule]


def padded_causal_mask(lengths: Any, width: int, device: Any) -> Any:
    """[b, 1, L, L] bool, True where attention is forbidden: future keys and padded keys."""
    import torch

    positions = torch.arange(width, device=device)
    future = positions[None, :] > positions[:, None]  # [L, L]: key after query
    padded = positions[None, :] >= lengths.to(device)[:, None]  # [b, L]: key is padding
    return (future[None, None] | padded[:, None, None, :]).contiguous()


@dataclass
class DeviceMicroBatch:
    """One padded micro-batch's tensors on the device; the 4-D mask is built per pass."""

    tokens: Any  # [b, L]
    position_ids: Any  # [b, L]
    labels: Any  # [b, L]
    loss_mask: Any  # [b, L] float32
    lengths: Any  # [b]


def to_device(mb: Any, device: Any) -> DeviceMicroBatch:
    return DeviceMicroBatch(mb.tokens.to(device), mb.position_ids.to(device),
                            mb.labels.to(device), mb.loss_mask.to(device), mb.lengths.to(device))


def model_inputs(mb: DeviceMicroBatch, explicit_mask: bool) -> dict[str, Any]:
    """The GPTModel arguments of one micro-batch (the explicit mask for the local spec)."""
    width = mb.tokens.shape[1]
    mask = padded_causal_mask(mb.lengths, width, mb.tokens.device) if explicit_mask else None
    return {"input_ids": mb.tokens, "position_ids": mb.position_ids, "attention_mask": mask,
            "labels": mb.labels}


# --------------------------------------------------------------------------- model
@dataclass
class Runtime:
    """Where the model runs and how that device is measured."""

    device: Any
    on_gpu: bool
    transformer_engine: bool
    dtype: Any


def start_megatron(on_gpu: bool, seed: int) -> None:
    """One-process distributed state and megatron's RNG (the CPU form with the CPU shims)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from megatron_packing.megatron.cpu_workarounds import apply_cpu_workarounds

    if on_gpu:
        torch.cuda.set_device(0)
    if not dist.is_initialized():
        from megatron_packing.demo.launch import free_port

        dist.init_process_group("nccl" if on_gpu else "gloo",
                                init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0)
    parallel_state.initialize_model_parallel()
    if on_gpu:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        apply_cpu_workarounds()
    torch.manual_seed(seed)


def build_gpt(workload: Workload, runtime: Runtime, seed: int) -> Any:
    """A megatron-core GPTModel for the workload (TE spec when available, else local)."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    bf16 = runtime.dtype == torch.bfloat16
    config = TransformerConfig(
        num_layers=workload.layers, hidden_size=workload.hidden,
        num_attention_heads=workload.heads, ffn_hidden_size=workload.ffn,
        hidden_dropout=0.0, attention_dropout=0.0,
        bf16=bf16, params_dtype=runtime.dtype,
        # bf16 scores: the fp32 softmax of the local spec would double the b x heads x L^2 tensors.
        attention_softmax_in_fp32=not bf16,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        use_cpu_initialization=not runtime.on_gpu,
        # The backward recomputes core attention one layer at a time (megatron's selective
        # recompute), so no layer keeps its L^2 probabilities; it needs the CUDA RNG tracker.
        # (TE's fused attention keeps no L^2 tensor and needs none.)
        recompute_granularity=("selective" if runtime.on_gpu and not runtime.transformer_engine
                               else None),
        calculate_per_token_loss=True,
    )
    spec = (get_gpt_layer_with_transformer_engine_spec() if runtime.transformer_engine
            else get_gpt_layer_local_spec())
    torch.manual_seed(seed)
    model = GPTModel(config, spec, vocab_size=workload.vocab,
                     max_sequence_length=workload.max_len, position_embedding_type="rope")
    return model.to(device=runtime.device, dtype=runtime.dtype)


def count_parameters(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- measurement
class UtilisationSampler:
    """Samples ``torch.cuda.utilization()`` (NVML) in a thread; nothing when NVML is missing."""

    def __init__(self, enabled: bool, period_s: float = 0.1) -> None:
        self.samples: list[float] = []
        self.period_s = period_s
        self.enabled = enabled and self._probe()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _probe() -> bool:
        import torch

        try:
            torch.cuda.utilization()
        except Exception:  # no pynvml / NVML: the table says n/a
            return False
        return True

    def __enter__(self) -> UtilisationSampler:
        if self.enabled:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        import torch

        while not self._stop.wait(self.period_s):
            self.samples.append(float(torch.cuda.utilization()))

    def text(self) -> str:
        return f"{statistics.mean(self.samples):.0f}" if self.samples else "n/a"


def reset_peak_memory(runtime: Runtime) -> None:
    import torch

    if runtime.on_gpu:
        from megatron.core import parallel_state

        # The local attention keeps its largest score buffer; drop it so each row's peak is its own.
        parallel_state.get_global_memory_buffer().buffer.clear()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return
    try:  # Linux: writing 5 resets the peak RSS (VmHWM) of this process
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass


def peak_memory_gib(runtime: Runtime) -> float:
    import torch

    if runtime.on_gpu:
        return torch.cuda.max_memory_allocated() / 2**30
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def synchronize(runtime: Runtime) -> None:
    import torch

    if runtime.on_gpu:
        torch.cuda.synchronize()


def run_pass(model: Any, batches: list[DeviceMicroBatch], explicit_mask: bool,
             backward: bool) -> None:
    """One pass over the whole batch: forward only, or forward+backward with accumulation.

    Each micro-batch's attention mask is built on the device inside the pass, as a step would.
    """
    import torch

    if not backward:
        model.eval()
        with torch.no_grad():
            for mb in batches:
                model(**model_inputs(mb, explicit_mask))
        return
    model.train()
    for mb in batches:
        per_token = model(**model_inputs(mb, explicit_mask))  # [b, L] float32
        (per_token * mb.loss_mask).sum().backward()
    model.zero_grad(set_to_none=True)


@dataclass
class Row:
    setting: Setting
    micro_batches: int
    real_tokens: int
    padded_tokens: int
    rates: dict[str, list[float]] = field(default_factory=dict)  # mode -> tokens/s per repeat
    utilisation: str = "n/a"
    peak_gib: float = float("nan")
    note: str = ""

    @property
    def pad_efficiency(self) -> float:
        return self.real_tokens / self.padded_tokens


def measure(model: Any, runtime: Runtime, workload: Workload, lengths: np.ndarray,
            setting: Setting, seed: int, deadline: float) -> Row:
    """Warm-ups then timed repeats of both modes for one setting."""
    import torch

    mbs = make_microbatches(lengths, setting, workload.vocab, seed)
    row = Row(setting, len(mbs), sum(mb.num_tokens for mb in mbs),
              sum(mb.padded_tokens for mb in mbs))
    if time.monotonic() > deadline:
        row.note = "skipped: time limit"
        return row
    reset_peak_memory(runtime)
    explicit_mask = not runtime.transformer_engine
    sampler = UtilisationSampler(runtime.on_gpu)
    try:
        batches = [to_device(mb, runtime.device) for mb in mbs]
        for mode, backward in (("fwd", False), ("fwd+bwd", True)):
            for _ in range(workload.warmups):
                run_pass(model, batches, explicit_mask, backward)
            synchronize(runtime)
            rates = []
            with sampler if backward else contextlib.nullcontext():
                for _ in range(workload.repeats):
                    if time.monotonic() > deadline:
                        row.note = "cut: time limit"
                        break
                    started = time.perf_counter()
                    run_pass(model, batches, explicit_mask, backward)
                    synchronize(runtime)
                    rates.append(row.real_tokens / (time.perf_counter() - started))
            row.rates[mode] = rates
    except torch.cuda.OutOfMemoryError:
        row.note = "out of GPU memory"
        model.zero_grad(set_to_none=True)
    row.utilisation = sampler.text()
    row.peak_gib = peak_memory_gib(runtime)
    return row


# --------------------------------------------------------------------------- table
def _rate(rates: list[float] | None) -> tuple[str, str]:
    if not rates:
        return "-", "-"
    return f"{statistics.median(rates):,.0f}", f"{min(rates):,.0f}"


def format_table(rows: list[Row], runtime: Runtime) -> list[str]:
    memory = "peak GPU GiB" if runtime.on_gpu else "peak RSS GiB"
    lines = [
        f"| setting | micro-batches | pad eff. | fwd tok/s median | fwd tok/s slowest "
        f"| fwd+bwd tok/s median | fwd+bwd tok/s slowest | fwd+bwd s/pass | fwd+bwd vs mbs 1 "
        f"| GPU util % "
        f"| {memory} | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    base_rates = rows[0].rates.get("fwd+bwd") if rows else None
    base = statistics.median(base_rates) if base_rates else None
    for row in rows:
        fwd, fwd_worst = _rate(row.rates.get("fwd"))
        both, both_worst = _rate(row.rates.get("fwd+bwd"))
        mine = row.rates.get("fwd+bwd")
        ratio = f"{statistics.median(mine) / base:.2f}x" if mine and base else "-"
        seconds = f"{row.real_tokens / statistics.median(mine):.3f}" if mine else "-"
        peak = "-" if math.isnan(row.peak_gib) else f"{row.peak_gib:.2f}"
        lines.append(f"| {row.setting.label} | {row.micro_batches} | {row.pad_efficiency:.3f} "
                     f"| {fwd} | {fwd_worst} | {both} | {both_worst} | {seconds} | {ratio} "
                     f"| {row.utilisation} | {peak} | {row.note} |")
    return lines


def describe(workload: Workload, runtime: Runtime, lengths: np.ndarray, params: int,
             seed: int) -> str:
    import torch
    from megatron.core import package_info

    where = (f"GPU {torch.cuda.get_device_name(0)}" if runtime.on_gpu
             else f"CPU, {torch.get_num_threads()} intra-op thread(s)")
    spec = "Transformer Engine spec" if runtime.transformer_engine else "local spec"
    dtype = str(runtime.dtype).replace("torch.", "")
    return (f"megatron-core {package_info.__version__} GPTModel ({spec}, RoPE, {dtype}): {workload.layers} layers, hidden "
            f"{workload.hidden}, {workload.heads} heads, FFN {workload.ffn}, vocab {workload.vocab}, "
            f"{params / 1e6:.1f}M parameters; {where}, torch {torch.__version__}. Workload: "
            f"{workload.examples} examples, log-uniform {workload.min_len}..{workload.max_len} "
            f"tokens (seed {seed}; {int(lengths.sum()):,} real tokens, longest {int(lengths.max()):,}); "
            f"{workload.warmups} warm-up + {workload.repeats} repeats per mode; balanced splitter; "
            f"real tokens/s.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true",
                        help="the same code on the CPU: small model, lengths and budgets / 32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit-s", type=float, default=330.0,
                        help="stop starting timed passes after this many seconds (default 330)")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads of the --tiny form (default 1: steady on a shared machine)")
    args = parser.parse_args(argv)
    if args.time_limit_s <= 0:
        parser.error(f"--time-limit-s must be > 0 seconds, got {args.time_limit_s}")
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")

    if args.tiny:
        # The CPU form on any machine: hide GPUs before CUDA starts, so that megatron-core's
        # CPU shims (which stand down wherever CUDA is available) apply.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    on_gpu = not args.tiny and torch.cuda.is_available()
    if not on_gpu and not args.tiny:
        print(NO_GPU_MESSAGE)
        return 0
    if not on_gpu:
        torch.set_num_threads(args.threads)
    started = time.monotonic()
    workload = TINY if args.tiny else FULL
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    import importlib.util

    te = on_gpu and importlib.util.find_spec("transformer_engine") is not None
    runtime = Runtime(device=torch.device("cuda" if on_gpu else "cpu"), on_gpu=on_gpu,
                      transformer_engine=te, dtype=torch.bfloat16 if on_gpu else torch.float32)
    start_megatron(on_gpu, args.seed)
    model = build_gpt(workload, runtime, args.seed)
    lengths = draw_lengths(workload, args.seed)
    print(describe(workload, runtime, lengths, count_parameters(model), args.seed), flush=True)
    deadline = started + args.time_limit_s
    rows = []
    for setting in settings(workload):
        rows.append(measure(model, runtime, workload, lengths, setting, args.seed, deadline))
        print(f"  {setting.label}: done at {time.monotonic() - started:.0f} s", flush=True)
    print("\n".join(format_table(rows, runtime)))
    print(f"total {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
