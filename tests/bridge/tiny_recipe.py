"""A tiny GPT ``ConfigContainer`` for Megatron-Bridge tests on CPU (gloo), and its external data.

`tiny_gpt_config` builds Bridge's own config objects (``GPTModelProvider`` with megatron-core's
local layer spec, ``TrainingConfig``, ``OptimizerConfig``, ...) for a 2-layer, hidden-64 GPT that
trains in seconds on 2 cores. Its dataset is `CountingDataProvider`: Bridge's
``DatasetProvider`` contract with ``dataloader_type="external"``, whose train "dataset" is an
iterator of ready micro-batches (`CountingBatches`) that Bridge passes through untouched
(``megatron/bridge/data/samplers.py`` ``build_pretraining_data_loader``: ``"external"`` returns
the dataset) and wraps in a ``RerunDataIterator``. Its ``save_state`` / ``restore_state`` are
what Bridge's checkpointing calls on ``train_data_iterator.iterable``.

Importing this module imports Bridge: call ``bridge_shims.apply()`` first (or at least
``bridge_shims.install_import_shims()`` where Transformer Engine is absent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.bridge.data.base import DatasetBuildContext, DatasetProvider
from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec
from megatron.bridge.training.config import (
    CheckpointConfig,
    ConfigContainer,
    DistributedDataParallelConfig,
    DistributedInitConfig,
    LoggerConfig,
    OptimizerConfig,
    RNGConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainingConfig,
    ValidationConfig,
)
from megatron.core.transformer.enums import AttnBackend

VOCAB = 128
SEQ_LENGTH = 64


class CountingBatches:
    """Micro-batches of counting sequences (token t+1 = token t + 1 mod vocab, random start), a
    pattern the tiny model learns within a few steps. Micro-batch ``k`` of data-parallel rank
    ``r`` depends only on ``(seed, r, k)``, so a run that restores ``position`` continues with
    exactly the batches an uninterrupted run sees.

    Batches are what Bridge's ``gpt_step.get_batch`` reads: ``tokens``, ``labels``,
    ``loss_mask``, ``position_ids`` and an explicit causal ``attention_mask`` (True = masked;
    megatron-core's local attention builds a default mask on CUDA only).
    """

    def __init__(self, *, seed: int, dp_rank: int, micro_batch_size: int, seq_length: int,
                 vocab_size: int) -> None:
        self.seed, self.dp_rank = seed, dp_rank
        self.micro_batch_size, self.seq_length, self.vocab_size = micro_batch_size, seq_length, vocab_size
        self.position = 0
        self.restored_from: int | None = None

    def __iter__(self) -> CountingBatches:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        seed = self.seed * 1_000_003 + self.dp_rank * 10_007 + self.position
        generator = torch.Generator().manual_seed(seed)
        self.position += 1
        mbs, seq = self.micro_batch_size, self.seq_length
        start = torch.randint(0, self.vocab_size, (mbs, 1), generator=generator)
        row = (start + torch.arange(seq + 1)) % self.vocab_size
        causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
        return {
            "tokens": row[:, :-1].contiguous(),
            "labels": row[:, 1:].contiguous(),
            "loss_mask": torch.ones(mbs, seq, dtype=torch.float32),
            "position_ids": torch.arange(seq).expand(mbs, seq).contiguous(),
            "attention_mask": causal.expand(mbs, 1, seq, seq).contiguous(),
        }

    # What Bridge's checkpointing calls on ``train_data_iterator.iterable``.
    def save_state(self) -> dict[str, Any]:
        return {"position": self.position, "dp_rank": self.dp_rank}

    def restore_state(self, state: dict[str, Any]) -> None:
        if state["dp_rank"] != self.dp_rank:
            raise ValueError(f"state of dp rank {state['dp_rank']} offered to dp rank {self.dp_rank}")
        self.position = self.restored_from = int(state["position"])


@dataclass(kw_only=True)
class CountingDataProvider(DatasetProvider):
    """Bridge ``DatasetProvider`` of `CountingBatches` (train split only), ``dataloader_type`` external."""

    seq_length: int = SEQ_LENGTH
    vocab_size: int = VOCAB
    micro_batch_size: int = 1
    seed: int = 1234
    dataloader_type: str = "external"
    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    # gpt_step.get_batch keeps the batch's attention_mask only when this is False.
    skip_getting_attention_mask_from_dataset: bool = False

    def build_datasets(self, context: DatasetBuildContext) -> tuple[Any, Any, Any]:
        dp_rank = context.pg_collection.dp.rank() if context.pg_collection is not None else 0
        train = CountingBatches(seed=self.seed, dp_rank=dp_rank, micro_batch_size=self.micro_batch_size,
                                seq_length=self.seq_length, vocab_size=self.vocab_size)
        self.last_train = train  # for tests: where restore_state put it
        return train, None, None


def tiny_gpt_config(*, train_iters: int = 6, tp: int = 1, pp: int = 1, micro_batch_size: int = 1,
                    global_batch_size: int = 4, use_distributed_optimizer: bool = False,
                    save: str | None = None, load: str | None = None, save_interval: int | None = None,
                    seed: int = 1234, vocab_size: int = VOCAB, seq_length: int = SEQ_LENGTH,
                    log_interval: int = 1, dropout: float = 0.0) -> ConfigContainer:
    """A tiny GPT (2 layers, hidden 64, 4 heads) on CPU with gloo: fp32, Adam lr 1e-3, constant LR,
    external `CountingDataProvider` data, ``torch_dist`` checkpoints when ``save`` / ``load`` are
    given (``ckpt_step`` on ``cfg.checkpoint`` picks a saved iteration). ``global_batch_size``
    must be a multiple of ``micro_batch_size * DP``. ``dropout`` sets hidden and attention
    dropout. Without Apex / TE, ``use_distributed_optimizer`` trains and saves but cannot load
    (see `bridge_shims`). The loss is Bridge's (``gpt_step.forward_step``)."""
    model = GPTModelProvider(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=256,
        num_attention_heads=4,
        seq_length=seq_length,
        vocab_size=vocab_size,
        make_vocab_size_divisible_by=8,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=False,
        transformer_layer_spec=local_layer_spec,
        attention_backend=AttnBackend.local,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        bf16=False,
        fp16=False,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        masked_softmax_fusion=False,
        cross_entropy_loss_fusion=False,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )
    optimizer = OptimizerConfig(
        optimizer="adam",
        lr=1e-3,
        min_lr=1e-3,
        weight_decay=0.0,
        clip_grad=1.0,
        bf16=False,
        fp16=False,
        params_dtype=torch.float32,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    return ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=train_iters, micro_batch_size=micro_batch_size,
                             global_batch_size=global_batch_size),
        validation=ValidationConfig(eval_iters=0, eval_interval=None),
        optimizer=optimizer,
        scheduler=SchedulerConfig(lr_decay_style="constant", lr_warmup_iters=0,
                                  start_weight_decay=0.0, end_weight_decay=0.0),
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer,
                                          overlap_grad_reduce=False, overlap_param_gather=False,
                                          grad_reduce_in_fp32=False, check_for_nan_in_grad=True),
        dataset=CountingDataProvider(seq_length=seq_length, vocab_size=vocab_size,
                                     micro_batch_size=micro_batch_size, seed=seed),
        logger=LoggerConfig(log_interval=log_interval),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=vocab_size - 1),
        checkpoint=CheckpointConfig(save=save, load=load, save_interval=save_interval,
                                    ckpt_format="torch_dist", fully_parallel_save=False,
                                    async_save=False),
        rng=RNGConfig(seed=seed),
        dist=DistributedInitConfig(distributed_backend="gloo", use_gloo_process_groups=True),
        mixed_precision=None,
    )


def on_cpu(cfg: ConfigContainer) -> ConfigContainer:
    """A user's recipe (say `examples/bridge/finetune_llama.py`'s) made to run on CPU with gloo,
    as `tiny_gpt_config` is: megatron-core's local layer spec and attention, no fused kernels,
    float32, gloo, synchronous checkpoints. Each change stands in for a GPU-only default (TE
    layers and attention, fused kernels, bf16, NCCL); the recipe is otherwise as written."""
    model = cfg.model
    model.transformer_layer_spec = local_layer_spec
    model.attention_backend = AttnBackend.local
    for flag in ("masked_softmax_fusion", "cross_entropy_loss_fusion",
                 "gradient_accumulation_fusion", "bias_activation_fusion", "bias_dropout_fusion",
                 "apply_rope_fusion", "persist_layer_norm"):
        setattr(model, flag, False)
    model.bf16 = model.fp16 = False
    model.params_dtype = model.pipeline_dtype = torch.float32
    cfg.optimizer.bf16 = cfg.optimizer.fp16 = False
    cfg.optimizer.params_dtype = torch.float32
    cfg.mixed_precision = None
    cfg.dist = DistributedInitConfig(distributed_backend="gloo", use_gloo_process_groups=True)
    cfg.checkpoint.fully_parallel_save = False
    cfg.checkpoint.async_save = False
    cfg.ddp.overlap_grad_reduce = cfg.ddp.overlap_param_gather = False
    return cfg
