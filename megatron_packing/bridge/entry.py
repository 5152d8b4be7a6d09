"""``finetune_packed(cfg, "sft.yaml")``: a Megatron-Bridge recipe trained on packed, DP-aligned steps.

Call it where a Bridge script calls ``finetune(cfg, forward_step)``, under ``torchrun``::

    from megatron_packing.bridge.entry import finetune_packed
    cfg = my_recipe()            # a Bridge ConfigContainer, with cfg.dataset = None
    raise SystemExit(finetune_packed(cfg, "sft.yaml"))

The recipe keeps everything Bridge owns (model, optimizer, scheduler, parallel sizes,
checkpoints, loggers); the YAML's ``data:`` section says what to train and its ``packing:``
section how to pack it. Bridge's ``setup()`` builds and loads; the library's step loop trains
(`megatron_packing.bridge.host`).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from megatron_packing.bridge import loader_state
from megatron_packing.bridge.recipe import (
    RecipeRefused,
    bridge_version,
    check_bridge_version,
    check_recipe,
    host_settings,
    packed_data_config,
)
from megatron_packing.config import ConfigError, PackingConfig
from megatron_packing.config.training import DataConfig
from megatron_packing.megatron.packing_settings import (
    check_examples_fit,
    resolve_packing_settings,
)
from megatron_packing.megatron.step_accounting import examples_the_run_trains
from megatron_packing.megatron.train_stream import TrainStream


def read_packing_yaml(path: str | Path) -> tuple[dict[str, Any], set[str], DataConfig]:
    """The YAML's ``packing:`` and ``data:`` sections, read as every command reads them."""
    from megatron_packing.config.sections import read_sections

    sections = read_sections(path, command="the Megatron-Bridge host", reads=("packing", "data"))
    return sections.packing_values, set(sections.packing_values), sections.data


def _load_train_data(data: DataConfig, *, vocab_limit: int | None) -> Any:
    """The training split, loaded on every rank with no collective (file locks order builds)."""
    from megatron_packing.config.data_loading import load_data_split
    from megatron_packing.data.tokenize import load_tokenizer

    if data.valid_paths:
        raise ConfigError("data.valid_paths: the Bridge host runs no validation yet; remove the "
                          "key (validate a saved checkpoint with Bridge's own evaluation)")
    dataset = load_data_split(data, data.paths)
    vocab = len(load_tokenizer(data.tokenizer))
    if vocab_limit is not None and vocab > vocab_limit:
        raise ConfigError(f"tokenizer {data.tokenizer} has {vocab} tokens but the model's "
                          f"vocabulary (model.vocab_size) holds {vocab_limit}; give the recipe "
                          "the same tokenizer or a vocab_size at least that large")
    return dataset


def size_schedule_in_examples(cfg: Any, total_examples: int, *, decay_given: bool) -> bool:
    """Size Bridge's finalized schedule to the examples the run trains, when that differs from
    ``train_iters x global_batch_size`` (runs over whole epochs) and the recipe did not set the
    decay length itself; the LR then reaches its minimum on the run's last step."""
    scheduler, batch = cfg.scheduler, int(cfg.train.global_batch_size)
    if decay_given or total_examples == int(cfg.train.train_iters) * batch:
        return False
    scheduler.lr_decay_steps = total_examples
    if getattr(scheduler, "lr_warmup_fraction", None) is not None:
        scheduler.lr_warmup_steps = scheduler.lr_warmup_fraction * total_examples
    scheduler.lr_warmup_steps = min(scheduler.lr_warmup_steps, total_examples - 1)
    if getattr(scheduler, "wsd_decay_steps", None) is not None:
        scheduler.wsd_decay_steps = min(scheduler.wsd_decay_steps, total_examples)
    return True


def finetune_packed(cfg: Any, packing_config: str | Path, *, step_log_dir: str | None = None,
                    forward_step: Any = None) -> int:
    """Train ``cfg`` (a Bridge ``ConfigContainer``) on the YAML's data, packed; the exit code.

    ``forward_step`` replaces the library's forward step (one packed row through the model,
    THD with Transformer Engine, the exact block-diagonal mask without it); ``step_log_dir``
    writes one JSONL record per step and rank.
    """
    from megatron.bridge.training.config import runtime_config_update
    from megatron.bridge.training.setup import setup
    from megatron.bridge.training.state import GlobalState
    from megatron.bridge.training.train import _finish_train
    from megatron.bridge.utils.common_utils import print_rank_0

    from megatron_packing.loader.dataloader import build_sft_dataloader
    from megatron_packing.megatron.cpu_workarounds import cuda_factories_on_cpu
    from megatron_packing.megatron.forward import make_forward_step
    from megatron_packing.megatron.step_loop import LoopEnd, run_steps

    check_bridge_version(bridge_version())
    source = str(packing_config)
    packing_values, explicit, data = read_packing_yaml(packing_config)
    check_recipe(cfg)
    cfg.dataset = packed_data_config(int(cfg.model.seq_length))
    decay_given = cfg.scheduler.lr_decay_iters is not None or getattr(
        cfg.scheduler, "lr_decay_samples", None) is not None
    runtime_config_update(cfg)
    dp_size = int(cfg.data_parallel_size)
    packing: PackingConfig = resolve_packing_settings(
        packing_values, host_settings(cfg), dp_size=dp_size, explicit_keys=explicit,
        source=source)
    vocab = getattr(cfg.model, "vocab_size", None)
    if vocab is not None:
        packing.check_token_ids(int(vocab), source=source)
    train_ds = _load_train_data(data, vocab_limit=None if vocab is None else int(vocab))
    if not packing.use_sequence_packing:
        check_examples_fit(train_ds.lengths, host_settings(cfg), f"{source} (data.paths)")
    iters = int(cfg.train.train_iters)

    def build_stream(dp_rank: int) -> TrainStream:
        loader = build_sft_dataloader(train_ds, packing, dp_rank=dp_rank, dp_size=dp_size,
                                      seed=packing.seed, total_steps=iters)
        return TrainStream(loader)

    stream = build_stream(0)  # DP rank 0's; another rank builds its own once its rank is known
    total = examples_the_run_trains(iters, len(stream.loader), len(train_ds),
                                    packing.global_batch_size)
    resized = size_schedule_in_examples(cfg, total, decay_given=decay_given)
    streams: list[TrainStream] = []

    def provider(num_samples: Any, dataset_config: Any, pg_collection: Any
                 ) -> tuple[Any, None, None]:
        """Bridge's dataset provider: it binds ``pg_collection`` because the name is here."""
        dp_rank = pg_collection.dp.rank()
        streams.append(stream if dp_rank == 0 else build_stream(dp_rank))
        return streams[-1], None, None

    state = GlobalState()
    state.cfg = cfg
    with cuda_factories_on_cpu():
        try:
            out = setup(state, provider)
        except SystemExit as stop:  # Bridge ends some failed checkpoint loads with status 0
            raise RuntimeError(
                f"Megatron-Bridge's setup() ended the process (exit status {stop.code!r}) before "
                "training began, most often while loading checkpoint.load / "
                "checkpoint.pretrained_checkpoint; its messages above say why") from stop
    stream = streams[0]
    print_rank_0(f"> megatron_packing: the run trains {total} examples over {iters} iterations"
                 + (f" ({len(stream.loader)} steps per epoch); the LR schedule is sized to them"
                    if resized else ""))
    if state.train_state.step > 0:
        print_rank_0("> " + loader_state.restore(
            stream, loader_state.loader_state_dir(cfg, out.checkpoint_manager),
            state.train_state.step, dp_rank=out.pg_collection.dp.rank(), dp_size=dp_size,
            consumed_samples=int(state.train_state.consumed_train_samples)))
    if forward_step is None:
        rsm = cfg.rerun_state_machine
        forward_step = make_forward_step(
            cp_size=out.pg_collection.cp.size(), cp_rank=out.pg_collection.cp.rank(),
            check_nan=bool(getattr(rsm, "check_for_nan_in_loss", False)),
            check_spiky=bool(getattr(rsm, "check_for_spiky_loss", False)))
    from megatron_packing.bridge.host import BridgeHost

    host = BridgeHost(state, out, stream, forward_step=forward_step,
                      pad_token_id=packing.pad_token_id, step_log_dir=step_log_dir)
    start = state.train_state.step
    result = run_steps(host, stream, start=start, stop=iters)
    exit_code = result.exit_code
    if result.end is LoopEnd.COMPLETED:
        save = cfg.checkpoint
        if save.save and result.step > start and save.save_interval != 0 and (
                save.save_interval is None or result.step % save.save_interval):
            host.save(result.step)
        print_rank_0(f"> training done at iteration {result.step}: "
                     f"{state.train_state.consumed_train_samples} examples")
    writer = state.tensorboard_logger
    if writer is not None:
        writer.flush()
    stream.close()
    _finish_train(state, out.checkpoint_manager)
    return exit_code


# Seconds the ranks other than 0 wait before exiting on a start-up refusal: torchrun ends every
# rank once one exits, and a late rank 0 would otherwise be ended before it prints.
REFUSAL_GRACE_S = 5.0


def run(cfg: Any, packing_config: str | Path, **kwargs: Any) -> int:
    """`finetune_packed`, with a user's mistake said in one line and exit code 2 (global rank 0
    prints it; no traceback). Anything else keeps its traceback: a fault, not a setting."""
    from megatron_packing.common.process_lifetime import end_with_torchrun_agent
    from megatron_packing.data import BadRecordError, CorruptStoreError

    end_with_torchrun_agent()  # a killed torchrun takes this rank and all it started with it
    try:
        return finetune_packed(cfg, packing_config, **kwargs)
    except (ConfigError, RecipeRefused, BadRecordError, CorruptStoreError) as error:
        if os.environ.get("RANK", "0") == "0":
            print(f"megatron_packing.bridge: error: {error}", file=sys.stderr, flush=True)
        else:
            time.sleep(REFUSAL_GRACE_S)
        return 2
