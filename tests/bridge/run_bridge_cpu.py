"""Test launcher: Megatron-Bridge's own ``pretrain()`` on the tiny GPT, on CPU with gloo.

    CUDA_VISIBLE_DEVICES= python -m torch.distributed.run --nproc-per-node 2 \\
        tests/bridge/run_bridge_cpu.py --out DIR [--save CKPT --save-interval 3] [--load CKPT]

Applies `bridge_shims`, builds `tiny_recipe.tiny_gpt_config` and runs
``megatron.bridge.training.pretrain.pretrain`` with Bridge's ``gpt_step.forward_step``. Writes,
under ``--out``:

- ``imports.json`` (rank 0, right after the imports): whether ``find_spec`` / ``sys.modules`` see
  Transformer Engine or NVRx, and megatron-core's own ``HAVE_TE`` probe;
- ``losses.jsonl``: one line per iteration from an ``on_train_step_end`` callback (data-parallel
  and tensor-parallel rank 0 of the last pipeline stage): the iteration, the loss (float and
  ``float.hex``), the grad norm, and the position the data iterator's ``restore_state`` set.

A rank ends with a normal interpreter exit, not ``os._exit``: megatron-core's torch_dist writer
starts a ``multiprocessing`` Manager (``filesystem_async.get_write_results_queue``, spawn) that
only the exit handlers shut down; skipped, it outlives the launch and holds its output pipe.
Bridge ends a failed checkpoint load with ``sys.exit()`` (status 0), so a caller checks the
lines, not only the exit status. The ``__main__`` guard matters: that spawned Manager re-imports
this file.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--train-iters", type=int, default=6)
    parser.add_argument("--save")
    parser.add_argument("--save-interval", type=int)
    parser.add_argument("--load")
    parser.add_argument("--ckpt-step", type=int, help="load this iteration, not the latest")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--global-batch-size", type=int, default=4)
    parser.add_argument("--distributed-optimizer", action="store_true")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--timings", help="write rank 0's train_step timings here (benchmarks)")
    return parser.parse_args(argv)


def _import_facts() -> dict[str, object]:
    from megatron.core.tensor_parallel import random as tp_random

    return {name: {"find_spec_is_none": importlib.util.find_spec(name) is None,
                   "in_sys_modules": name in sys.modules}
            for name in ("transformer_engine", "nvidia_resiliency_ext")} | {
        "megatron_core_HAVE_TE": tp_random.HAVE_TE}


def run(argv: list[str]) -> None:
    args = _parse(argv)
    import bridge_shims

    bridge_shims.apply()
    from megatron.bridge.training.callbacks import Callback
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain
    from megatron.core import parallel_state
    from tiny_recipe import tiny_gpt_config

    os.makedirs(args.out, exist_ok=True)
    if os.environ.get("RANK", "0") == "0":
        with open(os.path.join(args.out, "imports.json"), "w") as out:
            json.dump(_import_facts(), out)

    cfg = tiny_gpt_config(train_iters=args.train_iters, tp=args.tp, pp=args.pp,
                          global_batch_size=args.global_batch_size,
                          use_distributed_optimizer=args.distributed_optimizer,
                          save=args.save, load=args.load, save_interval=args.save_interval,
                          dropout=args.dropout, seq_length=args.seq_length)
    if args.timings:
        import step_timings

        step_timings.install(args.timings)
    cfg.checkpoint.ckpt_step = args.ckpt_step
    losses = os.path.join(args.out, "losses.jsonl")

    class WriteLosses(Callback):
        def on_train_step_end(self, context):  # noqa: ANN001, ANN202
            if not context.loss_dict or parallel_state.get_data_parallel_rank() != 0 \
                    or parallel_state.get_tensor_model_parallel_rank() != 0:
                return
            loss = float(context.loss_dict["lm loss"])
            train = getattr(context.state.cfg.dataset, "last_train", None)
            row = {"iteration": context.state.train_state.step + 1, "loss": loss, "loss_hex": loss.hex(),
                   "grad_norm": context.grad_norm, "skipped": bool(context.skipped_iter),
                   "restored_from": getattr(train, "restored_from", None)}
            with open(losses, "a") as out:
                out.write(json.dumps(row) + "\n")

    pretrain(cfg, forward_step, callbacks=[WriteLosses()])


if __name__ == "__main__":
    run(sys.argv[1:])  # a normal exit: see the module's docstring
