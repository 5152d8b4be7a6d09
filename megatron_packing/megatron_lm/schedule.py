"""The LR schedule sized to the examples the run will train, so it ends at ``--min-lr``.

Megatron sizes warmup and decay as ``iters x --global-batch-size`` examples. With packing, a run
inside one epoch trains exactly that many (the drift is repaid by the final iteration), but each
completed epoch ends with a step that takes only what remains, so a run over several epochs
trains fewer. The count is known before the first step: every epoch trains all N examples in
its ``steps_per_epoch`` steps, and the run's last, partial epoch trains ``steps x B`` examples.
When the two differ, Megatron's own sample-based sizing (``--train-samples``,
``--lr-decay-samples``, ``--lr-warmup-samples``) is used for the scheduler instead, with that
count; the LR then reaches ``--min-lr`` on the run's last iteration.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def sized_in_examples(args: Any, total_examples: int) -> bool:
    """Whether `schedule_in_examples` sizes Megatron's schedule in ``total_examples``: the run
    trains another count than ``iters x B`` and ``--lr-decay-iters`` does not set the decay."""
    return (total_examples != args.train_iters * args.global_batch_size
            and args.lr_decay_iters is None)


@contextlib.contextmanager
def schedule_in_examples(args: Any, total_examples: int) -> Iterator[bool]:
    """While active, Megatron's ``get_optimizer_param_scheduler`` sizes the schedule in
    ``total_examples``; yields whether it had to (False: ``iters x B`` is already exact, or
    ``--lr-decay-iters`` chose the decay length explicitly).

    Only Megatron's own arguments are set, and every one is put back on exit, so the iteration
    horizon (``--train-iters``) the loop and the checkpoints see is unchanged.
    """
    batch = args.global_batch_size
    if not sized_in_examples(args, total_examples):
        yield False
        return
    names = ("train_iters", "train_samples", "lr_decay_samples", "lr_warmup_samples",
             "lr_wsd_decay_samples")
    saved = {name: getattr(args, name) for name in names}
    args.train_samples = total_examples
    args.lr_decay_samples = total_examples
    args.lr_warmup_samples = args.lr_warmup_iters * batch
    if args.lr_wsd_decay_iters is not None:
        args.lr_wsd_decay_samples = args.lr_wsd_decay_iters * batch
    args.train_iters = None
    try:
        yield True
    finally:
        for name, value in saved.items():
            setattr(args, name, value)
