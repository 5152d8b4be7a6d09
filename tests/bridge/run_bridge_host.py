"""Test launcher: the Bridge host (`megatron_packing.bridge.entry.run`) on the tiny GPT, CPU, gloo.

    torchrun --nproc-per-node 2 tests/bridge/run_bridge_host.py --packing-config sft.yaml \
        --train-iters 6 --step-log-dir logs [--tp 2] [--pp 2] [--save ckpt --save-interval 3]

Applies `bridge_shims`, builds `tiny_recipe.tiny_gpt_config` (the recipe a user would write,
with ``dataset = None`` and the per-token loss the host asks for) and hands it to the host with
the YAML. The ``__main__`` guard matters: torch_dist's checkpoint writer may start processes that
re-import this file.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VOCAB = 2816  # the demo tokenizer's 2815 tokens, padded to a multiple of 8


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--packing-config", required=True)
    parser.add_argument("--train-iters", type=int, default=6)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--save")
    parser.add_argument("--load")
    parser.add_argument("--save-interval", type=int)
    parser.add_argument("--step-log-dir")
    parser.add_argument("--distributed-optimizer", action="store_true")
    parser.add_argument("--cosine", action="store_true", help="warmup 2 iterations, cosine decay")
    parser.add_argument("--llama", action="store_true",
                        help="the recipe of examples/bridge/finetune_llama.py, small, on CPU")
    parser.add_argument("--timings", help="write rank 0's train_step timings here (benchmarks)")
    parser.add_argument("--recipe", nargs="*", default=[],
                        help="FIELD=VALUE overrides of the recipe, e.g. train.micro_batch_size=2")
    return parser.parse_args(argv)


def build_recipe(args: argparse.Namespace):  # noqa: ANN201
    from tiny_recipe import on_cpu, tiny_gpt_config

    if args.llama:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "bridge"))
        from finetune_llama import llama_recipe

        small = {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB}
        return on_cpu(llama_recipe(train_iters=args.train_iters,
                                   global_batch_size=args.global_batch_size,
                                   seq_length=args.seq_length, tp=args.tp, pp=args.pp,
                                   save=args.save, load=args.load, lr=1e-3, small=small))
    cfg = tiny_gpt_config(train_iters=args.train_iters, tp=args.tp, pp=args.pp,
                          global_batch_size=args.global_batch_size,
                          use_distributed_optimizer=args.distributed_optimizer,
                          save=args.save, load=args.load, save_interval=args.save_interval,
                          vocab_size=VOCAB, seq_length=args.seq_length)
    cfg.dataset = None  # the host trains the YAML's data: section
    cfg.model.calculate_per_token_loss = True
    if args.cosine:
        cfg.scheduler.lr_decay_style = "cosine"
        cfg.scheduler.lr_warmup_iters = 2
        cfg.optimizer.min_lr = 1e-4
    for item in args.recipe:
        path, _, text = item.partition("=")
        owner = cfg
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        setattr(owner, name, _value(text))
    return cfg


def _value(text: str):  # noqa: ANN202
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def run(argv: list[str]) -> int:
    args = _parse(argv)
    import bridge_shims

    bridge_shims.apply()
    from megatron_packing.bridge.entry import run as run_host

    if args.timings:
        import step_timings

        step_timings.install(args.timings)

    cfg = build_recipe(args)
    return run_host(cfg, args.packing_config, step_log_dir=args.step_log_dir)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
