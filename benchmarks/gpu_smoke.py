"""GPU smoke test of the Megatron-LM entry point: 20 iterations of a small GPT on one GPU, and
packed against unpacked loss on the row format the GPU uses.

1. ``torchrun --nproc-per-node 1 -m megatron_packing.megatron_lm`` trains a small GPT (bf16,
   megatron-core, Megatron-LM's own loop pieces) for 20 iterations on the shipped demo chats;
   every step's loss must be finite and the last below the first.
2. One packed row of several real examples goes through a megatron-core GPT twice: packed, and
   each example alone. With Transformer Engine the packed row is THD (`PackedSeqParams`);
   without it THD attention cannot run, which the table says plainly, and the packed row uses
   the exact block-diagonal mask on the GPU instead. The token losses must agree.

One table is printed. Without a GPU it prints why and exits 0, having run nothing.
Megatron-LM's training package must be importable (``MEGATRON_LM_PATH`` or
``../shared/third_party/megatron-lm``), as for the entry point itself.

Usage: python benchmarks/gpu_smoke.py [--iters 20] [--keep DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MEGATRON_LM = Path(os.environ.get("MEGATRON_LM_PATH",
                                  ROOT.parent / "shared" / "third_party" / "megatron-lm"))

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "2048", "--max-position-embeddings", "2048", "--micro-batch-size", "1", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--weight-decay", "0.01", "--bf16", "--tokenizer-type", "NullTokenizer", "--vocab-size", "2815", "--calculate-per-token-loss", "--position-embedding-type", "learned_absolute", "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "1234", "--log-interval", "5", "--global-batch-size", "64", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(MEGATRON_LM), str(ROOT), env.get("PYTHONPATH", "")])
    env.update(CUDA_DEVICE_MAX_CONNECTIONS="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    return env


def train_through_the_entry_point(work: Path, iters: int, te: bool) -> tuple[bool, str]:
    chats = (ROOT / "examples" / "data" / "demo_chat.jsonl").read_text()
    (work / "train.jsonl").write_text(chats)
    (work / "sft.yaml").write_text(
        "packing:\n  align_packing_bins_to_dp: true\n  oversize_policy: truncate\n"
        f"data:\n  paths: [{work / 'train.jsonl'}]\n  tokenizer: {ROOT / 'examples' / 'tokenizer'}\n"
        f"  cache_dir: {work / 'cache'}\n")
    impl = ["--transformer-impl", "transformer_engine" if te else "local"]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
               "-m", "megatron_packing.megatron_lm", "--packing-config", str(work / "sft.yaml"),
               "--train-iters", str(iters), "--packing-log-dir", str(work / "log"),
               *MODEL, *impl]
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=300)
    records = work / "log" / "steps_rank0.jsonl"
    if done.returncode != 0 or not records.exists():
        return False, f"exit {done.returncode}: {(done.stdout + done.stderr)[-600:]!r}"
    steps = [json.loads(line) for line in records.read_text().splitlines() if line]
    steps = [s for s in steps if "examples" in s]
    losses = [s["loss"] for s in steps]
    ok = (len(steps) == iters and all(loss == loss and abs(loss) < 1e9 for loss in losses)
          and losses[-1] < losses[0])
    step_ms = sorted(s["step_ms"] for s in steps[2:]) or [0.0]
    return ok, (f"{len(steps)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
                f"median step {step_ms[len(step_ms) // 2]:.0f} ms")


def packed_against_unpacked(work: Path, te: bool) -> tuple[bool, str]:
    import torch

    from megatron_packing.config import PackingConfig
    from megatron_packing.data import load_sft_dataset
    from megatron_packing.loader.dataloader import build_sft_dataloader
    from megatron_packing.megatron.packed_seq import block_diagonal_causal_mask, packed_seq_params

    torch.distributed.init_process_group("nccl", init_method="tcp://127.0.0.1:29533",
                                         world_size=1, rank=0)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=4,
                               hidden_dropout=0.0, attention_dropout=0.0,
                               params_dtype=torch.float32, calculate_per_token_loss=True)
    spec = get_gpt_layer_with_transformer_engine_spec() if te else get_gpt_layer_local_spec()
    model = GPTModel(config, spec, vocab_size=2815, max_sequence_length=2048,
                     position_embedding_type="learned_absolute").cuda().eval()
    # The first planned step of the real loader over the demo chats; its fullest row.
    dataset = load_sft_dataset([str(work / "train.jsonl")], str(ROOT / "examples" / "tokenizer"),
                               cache_dir=str(work / "cache"), show_progress=False)
    packing = PackingConfig(global_batch_size=32, bin_capacity=2048, oversize_policy="truncate")
    batch = next(iter(build_sft_dataloader(dataset, packing, dp_rank=0, dp_size=1, seed=1)))
    row = max(batch.micro_batches, key=lambda mb: len(mb.example_indices))
    device = torch.device("cuda")
    with torch.no_grad():
        if te:
            packed = model(row.tokens.to(device), row.position_ids.to(device), None,
                           labels=row.labels.to(device),
                           packed_seq_params=packed_seq_params(row, device))
        else:
            mask = block_diagonal_causal_mask(row.cu_seqlens_padded, row.tokens.shape[1])
            packed = model(row.tokens.to(device), row.position_ids.to(device), mask.to(device),
                           labels=row.labels.to(device))
        worst = 0.0
        starts, ends = row.cu_seqlens_padded.tolist(), row.cu_seqlens.tolist()
        real = [b - a for a, b in zip(ends, ends[1:], strict=False)]
        for start, n in zip(starts, real, strict=False):
            tokens = row.tokens[:, start:start + n].to(device)
            labels = row.labels[:, start:start + n].to(device)
            positions = torch.arange(n, device=device)[None]
            mask = block_diagonal_causal_mask(torch.tensor([0, n]), n).to(device)
            alone = model(tokens, positions, mask, labels=labels)[0, :n - 1]
            inside = packed[0, start:start + n - 1]
            worst = max(worst, float(((alone - inside).abs() / alone.abs().clamp(min=1e-6)).max()))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    what = ("THD (Transformer Engine)" if te
            else "block-diagonal mask; THD skipped: Transformer Engine is not installed")
    return worst <= 2e-3, (f"{what}; {len(real)} examples in one row, max relative token-loss "
                           f"difference {worst:.2e}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--keep", type=Path, default=None, help="keep the run's files here")
    options = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device here; this smoke test needs one GPU. Nothing was run.")
        return 0
    if not (MEGATRON_LM / "megatron" / "training" / "training.py").is_file():
        print(f"gpu_smoke: Megatron-LM's training package not found at {MEGATRON_LM} "
              "(set MEGATRON_LM_PATH). Nothing was run.")
        return 0
    sys.path.insert(0, str(MEGATRON_LM))
    te = importlib.util.find_spec("transformer_engine") is not None
    work = options.keep or Path(tempfile.mkdtemp(prefix="gpu_smoke_"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, check in (("entry point, 20 iterations", lambda: train_through_the_entry_point(
            work, options.iters, te)), ("packed == unpacked loss", lambda: packed_against_unpacked(work, te))):
        started = time.perf_counter()
        try:
            ok, detail = check()
        except Exception as error:  # the table reports it; the exit code says it failed
            ok, detail = False, f"{type(error).__name__}: {error}"
        rows.append((name, "pass" if ok else "FAIL", detail, time.perf_counter() - started))
    print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; Transformer Engine: "
          f"{'yes' if te else 'no'}")
    print("| check | result | detail | s |")
    print("|---|---|---|---|")
    for name, result, detail, seconds in rows:
        print(f"| {name} | {result} | {detail} | {seconds:.1f} |")
    return 0 if all(result == "pass" for _, result, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
