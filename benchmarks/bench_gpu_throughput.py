"""Measured padded-mode throughput on a GPU: fixed micro-batch sizes against token budgets.

A small causal transformer (torch only) runs forward and forward+backward over the same global
batches split by each setting (the sampler's rules: per-rank share sorted longest first, cut by
the splitter). Reports real tokens/s, padding efficiency, GPU utilisation (when NVML answers) and
peak memory. Without a GPU it prints a message and exits cleanly.

Usage: python benchmarks/bench_gpu_throughput.py [--max-len 8192] [--batches 2] [--layers 4]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_packing.packing.microbatch import (  # noqa: E402
    fixed_size_microbatches,
    make_token_balanced_microbatches,
    sort_by_length,
)


def build_model(torch, vocab: int, hidden: int, layers: int, heads: int, max_len: int):
    nn = torch.nn

    class TinyCausalLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, hidden)
            self.position = nn.Embedding(max_len, hidden)
            layer = nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0,
                                               batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, layers)
            self.head = nn.Linear(hidden, vocab, bias=False)

        def forward(self, tokens, lengths):
            width = tokens.shape[1]
            positions = torch.arange(width, device=tokens.device)
            x = self.embed(tokens) + self.position(positions)[None]
            causal = nn.Transformer.generate_square_subsequent_mask(width, device=tokens.device,
                                                                    dtype=x.dtype)
            padding = positions[None, :] >= lengths[:, None]
            x = self.blocks(x, mask=causal, src_key_padding_mask=padding, is_causal=True)
            return self.head(x)

    return TinyCausalLM()


def split(lengths: np.ndarray, budget: int | None, mbs: int, method: str) -> list[list[int]]:
    positions = list(range(len(lengths)))
    if budget is None:
        return fixed_size_microbatches(positions, mbs)
    order = sort_by_length(positions, lengths)
    return make_token_balanced_microbatches(order, lengths, budget, method=method)


def utilisation(torch) -> float | None:
    try:
        return float(torch.cuda.utilization())
    except Exception:  # NVML missing: report nothing rather than guess
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-len", type=int, default=8192, help="longest example (tokens)")
    parser.add_argument("--examples", type=int, default=32, help="examples per rank per step")
    parser.add_argument("--batches", type=int, default=2, help="steps timed per setting")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--budgets", type=int, nargs="*", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--method", default="balanced", choices=["greedy", "balanced"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("bench_gpu_throughput: no CUDA GPU found; nothing measured (run it on a GPU machine).")
        return 0
    device = torch.device("cuda")
    torch.manual_seed(args.seed)
    model = build_model(torch, args.vocab, args.hidden, args.layers, args.heads, args.max_len)
    model = model.to(device=device, dtype=torch.bfloat16)
    rng = np.random.default_rng(args.seed)
    steps = [np.exp(rng.uniform(math.log(64), math.log(args.max_len), args.examples)).astype(np.int64)
             for _ in range(args.batches)]
    settings = [("fixed mbs=1", None, 1), ("fixed mbs=2", None, 2)]
    settings += [(f"budget {b}", b, 1) for b in args.budgets]
    print(f"model: {args.layers} layers, hidden {args.hidden}, bf16; {args.examples} examples/step, "
          f"lengths log-uniform 64..{args.max_len}, splitter {args.method}, {torch.cuda.get_device_name()}")
    print("| setting | micro-batches/step | pad eff. | fwd tok/s | fwd+bwd tok/s | util % | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    for label, budget, mbs in settings:
        rates = {}
        util = []
        torch.cuda.reset_peak_memory_stats()
        counts, real, padded = [], 0, 0
        for mode in ("fwd", "fwd+bwd"):
            elapsed, tokens = 0.0, 0
            for step, lengths in enumerate(steps):
                schedule = split(lengths, budget, mbs, args.method)
                counts.append(len(schedule))
                torch.cuda.synchronize()
                started = time.perf_counter()
                for group in schedule:
                    width = int(lengths[group].max())
                    batch = torch.randint(1, args.vocab, (len(group), width), device=device)
                    group_lengths = torch.as_tensor(lengths[group], device=device)
                    if mode == "fwd":
                        with torch.no_grad():
                            model(batch, group_lengths)
                    else:
                        logits = model(batch, group_lengths)
                        loss = torch.nn.functional.cross_entropy(
                            logits[:, :-1].float().reshape(-1, args.vocab), batch[:, 1:].reshape(-1))
                        loss.backward()
                    if mode == "fwd" and step == 0:
                        real += int(lengths[group].sum())
                        padded += len(group) * width
                torch.cuda.synchronize()
                util.append(utilisation(torch))
                if step > 0 or args.batches == 1:  # the first step warms up kernels
                    elapsed += time.perf_counter() - started
                    tokens += int(lengths.sum())
                model.zero_grad(set_to_none=True)
            rates[mode] = tokens / elapsed if elapsed else float("nan")
        measured = [u for u in util if u is not None]
        util_text = f"{np.mean(measured):.0f}" if measured else "n/a"
        peak = torch.cuda.max_memory_allocated() / 2**30
        print(f"| {label} | {np.mean(counts):.1f} | {real / padded:.3f} | {rates['fwd']:.0f} "
              f"| {rates['fwd+bwd']:.0f} | {util_text} | {peak:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
