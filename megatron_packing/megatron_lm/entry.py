"""``python -m megatron_packing.megatron_lm``: packed, DP-aligned SFT with Megatron-LM's machinery.

Run it like ``pretrain_gpt.py``, from a Megatron-LM checkout (its folder on ``PYTHONPATH``),
under ``torchrun``, with the usual Megatron arguments plus ``--packing-config train.yaml``:

    torchrun --nproc-per-node 8 -m megatron_packing.megatron_lm \\
        --packing-config sft.yaml --calculate-per-token-loss --micro-batch-size 1 \\
        --global-batch-size 128 --seq-length 4096 --train-iters 2000 ... (model, optimizer,
        parallelism, --save / --load, --tensorboard-dir, --wandb-project as usual)

Megatron-LM builds everything but the data and the step loop: ``initialize_megatron``, the GPT
model provider (``model_provider`` + ``gpt_builders``), ``setup_model_and_optimizer`` (DDP,
distributed optimizer, ``--load``), ``save_checkpoint`` and its writers. The loop is
`megatron_packing.megatron_lm.loop.train`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from functools import partial
from typing import Any

from megatron_packing.config import ConfigError
from megatron_packing.megatron.trainer_config import DataConfig
from megatron_packing.megatron_lm.arguments import (
    add_packing_arguments,
    check_megatron_arguments,
    resolve_packing_config,
)
from megatron_packing.megatron_lm.data import TrainStream, restore_loader_state
from megatron_packing.packed.collate import PackedBatch


def read_packing_yaml(path: str) -> tuple[dict[str, Any], set[str], DataConfig]:
    """The YAML's ``packing:`` section (its keys checked by name; the values are judged once
    Megatron's arguments complete them) with the keys it sets, and its ``data:`` section."""
    from megatron_packing.config import YAML_KEYS, dataclass_from_mapping, read_yaml_mapping
    from megatron_packing.config.yaml_io import check_mapping

    document = read_yaml_mapping(path)
    packing_section = document.get("packing") or {}
    check_mapping(packing_section, YAML_KEYS, source=path, what="packing key")
    data = dataclass_from_mapping(DataConfig, document.get("data") or {}, source=path,
                                  what="data key")
    if not data.paths:
        raise ConfigError(f"{path}: data.paths is empty; list the SFT JSON/JSONL files to train on")
    if not data.tokenizer:
        raise ConfigError(f"{path}: data.tokenizer is empty; give a tokenizer directory with a "
                          "chat template")
    return dict(packing_section), set(packing_section), data


def _load_datasets(data: DataConfig, *, vocab_limit: int) -> tuple[Any, Any]:
    """(train, valid or None). Global rank 0 builds the length index first; the others read it."""
    import torch.distributed as dist

    from megatron_packing.data import load_sft_dataset
    from megatron_packing.data.tokenize import load_tokenizer

    def load(paths: list[str]) -> Any:
        return load_sft_dataset(paths, data.tokenizer, loss_on=data.loss_on,
                                on_bad_record=data.on_bad_record, cache_dir=data.cache_dir,
                                show_progress=False)

    datasets = None
    for turn in (0, 1):
        if (dist.get_rank() == 0) == (turn == 0):
            datasets = (load(data.paths), load(data.valid_paths) if data.valid_paths else None)
        dist.barrier()
    vocab = len(load_tokenizer(data.tokenizer))
    if vocab > vocab_limit:
        raise ConfigError(
            f"tokenizer {data.tokenizer} has {vocab} tokens but the model's padded vocabulary "
            f"holds {vocab_limit}; give Megatron the same tokenizer (--tokenizer-type / "
            "--tokenizer-model) or a --vocab-size at least that large")
    assert datasets is not None
    return datasets


def main(argv: list[str] | None = None) -> int:
    """Initialise Megatron-LM, build model, optimizer and loaders, train, save."""
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    from megatron.core import parallel_state as ps
    from megatron.core.enums import ModelType
    from megatron.training import get_args, print_rank_0
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import setup_model_and_optimizer

    from megatron_packing.loader import build_sft_dataloader
    from megatron_packing.megatron.cpu_workarounds import cpu_only
    from megatron_packing.megatron_lm.forward import make_forward_step
    from megatron_packing.megatron_lm.loop import save, train

    check_megatron_arguments(parse_args(extra_args_provider=add_packing_arguments))
    initialize_megatron(extra_args_provider=add_packing_arguments, allow_no_cuda=cpu_only())
    args = get_args()
    dp_size = ps.get_data_parallel_world_size()
    dp_rank = ps.get_data_parallel_rank()
    packing_yaml, explicit, data = read_packing_yaml(args.packing_config)
    packing = resolve_packing_config(packing_yaml, args, dp_size=dp_size, explicit_keys=explicit,
                                     source=args.packing_config)
    train_ds, valid_ds = _load_datasets(data, vocab_limit=args.padded_vocab_size)

    from gpt_builders import gpt_builder
    from model_provider import model_provider

    model, optimizer, scheduler = setup_model_and_optimizer(
        partial(model_provider, gpt_builder), ModelType.encoder_or_decoder)
    _wire_grad_sync(model, optimizer, args)

    loader = build_sft_dataloader(train_ds, packing, dp_rank=dp_rank, dp_size=dp_size,
                                  seed=packing.seed, total_steps=args.train_iters,
                                  num_workers=args.packing_num_workers)
    stream = TrainStream(loader)
    if args.iteration > 0:
        path = restore_loader_state(stream, args.load, args.iteration, dp_rank)
        print_rank_0(f"> restored the packing loader state of iteration {args.iteration} "
                     f"from {path}")
        if stream.counter.examples != args.consumed_train_samples:
            raise RuntimeError(
                f"checkpoint iteration {args.iteration}: Megatron counts "
                f"{args.consumed_train_samples} consumed samples but the loader state "
                f"{stream.counter.examples} examples; the checkpoint was not written by this "
                "entry point's loop")

    make_valid_steps = None
    if valid_ds is not None:
        def make_valid_steps() -> Iterator[PackedBatch]:
            return iter(build_sft_dataloader(valid_ds, packing, dp_rank=dp_rank, dp_size=dp_size,
                                             seed=packing.seed, eval_mode=True))

    forward_step = make_forward_step(cp_size=ps.get_context_parallel_world_size(),
                                     cp_rank=ps.get_context_parallel_rank())
    start = args.iteration
    last = train(args, model=model, optimizer=optimizer, scheduler=scheduler, stream=stream,
                 forward_step=forward_step, dp_size=dp_size, pad_token_id=packing.pad_token_id,
                 make_valid_steps=make_valid_steps)
    if args.save and last > start and (not args.save_interval or last % args.save_interval):
        save(args, last, model, optimizer, scheduler, stream,
             getattr(args, "num_floating_point_operations_so_far", 0))
    print_rank_0(f"> training done at iteration {last}: {args.consumed_train_samples} examples")
    return 0


def _wire_grad_sync(model: list[Any], optimizer: Any, args: Any) -> None:
    """What Megatron-LM's ``train()`` sets on the model config before its first step."""
    from megatron.core.utils import get_model_config

    from megatron_packing.megatron.ddp import wire_megatron_grad_sync

    wire_megatron_grad_sync(model, align_grad_reduce=args.align_grad_reduce,
                            align_param_gather=args.align_param_gather)
    get_model_config(model[0]).grad_scale_func = optimizer.scale_loss
