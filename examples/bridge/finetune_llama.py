"""Fine-tune a Llama architecture through Megatron-Bridge on packed, DP-aligned steps.

    torchrun --nproc-per-node 8 examples/bridge/finetune_llama.py --packing-config sft.yaml \
        --hf-config /path/to/llama/config.json --save ckpt --train-iters 2000

Megatron-Bridge turns the Hugging Face configuration into a Megatron GPT provider (random
weights here; give ``checkpoint.pretrained_checkpoint`` a converted checkpoint to fine-tune real
ones); the recipe sets parallelism, optimizer, schedule and checkpoints as any Bridge recipe
does, with ``dataset = None``: the training YAML's ``data:`` section is what is trained, packed
as its ``packing:`` section says. Without ``--hf-config`` a small Llama configuration is built
in place (no hub access).
"""

from __future__ import annotations

import argparse
import sys


def llama_recipe(*, hf_config: str | None = None, train_iters: int = 100,
                 global_batch_size: int = 128, seq_length: int = 4096, tp: int = 1, pp: int = 1,
                 save: str | None = None, load: str | None = None, save_interval: int = 100,
                 lr: float = 1e-5, small: dict | None = None):  # noqa: ANN201
    """A Bridge ``ConfigContainer`` for SFT of a Llama model on packed rows of ``seq_length``."""
    from megatron.bridge import AutoBridge
    from megatron.bridge.training.config import (
        CheckpointConfig,
        ConfigContainer,
        DistributedDataParallelConfig,
        LoggerConfig,
        OptimizerConfig,
        RNGConfig,
        SchedulerConfig,
        TokenizerConfig,
        TrainingConfig,
        ValidationConfig,
    )
    from transformers import AutoConfig, LlamaConfig

    if hf_config is not None:
        config = AutoConfig.from_pretrained(hf_config)
    else:  # a small Llama, built in place
        config = LlamaConfig(**{"hidden_size": 1024, "intermediate_size": 2816,
                                "num_hidden_layers": 8, "num_attention_heads": 16,
                                "num_key_value_heads": 4, "vocab_size": 32000,
                                "max_position_embeddings": seq_length,
                                "architectures": ["LlamaForCausalLM"], **(small or {})})
    model = AutoBridge.from_hf_config(config).to_megatron_provider(load_weights=False)
    model.seq_length = seq_length
    model.tensor_model_parallel_size = tp
    model.pipeline_model_parallel_size = pp
    model.sequence_parallel = tp > 1
    model.calculate_per_token_loss = True  # packed steps differ in loss tokens
    return ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=train_iters, global_batch_size=global_batch_size,
                             micro_batch_size=1),  # one packed row per micro-batch
        validation=ValidationConfig(eval_iters=0, eval_interval=None),
        optimizer=OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr / 10, weight_decay=0.01,
                                  clip_grad=1.0, bf16=False, fp16=False),
        scheduler=SchedulerConfig(lr_decay_style="cosine", lr_warmup_iters=10,
                                  start_weight_decay=0.01, end_weight_decay=0.01),
        ddp=DistributedDataParallelConfig(),
        dataset=None,  # the training YAML's data: section, packed by megatron_packing
        logger=LoggerConfig(log_interval=1),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer",
                                  vocab_size=config.vocab_size - 1),
        checkpoint=CheckpointConfig(save=save, load=load, save_interval=save_interval,
                                    ckpt_format="torch_dist"),
        rng=RNGConfig(seed=1234),
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packing-config", required=True, help="the training YAML")
    parser.add_argument("--hf-config", help="a Hugging Face config.json (or its folder)")
    parser.add_argument("--train-iters", type=int, default=100)
    parser.add_argument("--global-batch-size", type=int, default=128)
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--save")
    parser.add_argument("--load")
    args = parser.parse_args(argv)
    from megatron_packing.bridge.entry import run

    cfg = llama_recipe(hf_config=args.hf_config, train_iters=args.train_iters,
                       global_batch_size=args.global_batch_size, seq_length=args.seq_length,
                       tp=args.tp, pp=args.pp, save=args.save, load=args.load)
    return run(cfg, args.packing_config)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
