"""The one place where the supported megatron-core releases differ for this library.

Two stacks are supported and tested: megatron-core 0.16.x (Python 3.11+, whose wheel has no
``megatron.training``: Megatron-LM's training package comes from a checkout at tag
``core_v0.16.x``) and megatron-core 0.19.x (Python 3.12+, whose wheel ships
``megatron.training``). Any other release is refused when the Megatron-LM entry point is
imported (`refuse_unsupported_megatron_core`), naming the version found and the range.

What differs, and what the rest of the library calls instead:

* arguments and initialisation (`parse_and_initialize`): 0.16's ``initialize_megatron`` parses
  and validates the arguments itself (``extra_args_provider=``); 0.19's takes no parser
  arguments, and ``parse_and_validate_args`` must run first;
* ``setup_model_and_optimizer`` (`setup_model_and_optimizer`): 0.16 takes
  ``(model_provider_func, model_type)``, 0.19 ``(model_type, model_provider_func)``;
* THD context-parallel slicing (`thd_cp_slicer`): 0.16 has megatron-core's
  ``get_thd_batch_on_this_cp_rank``; 0.19 replaced it with a process-group based
  ``get_batch_on_this_cp_rank``, so the library's own split (the same convention) is used;
* ``PackedSeqParams`` gains ``total_tokens``, ``seq_idx``, ``tokens_per_sample`` and
  ``pad_between_seqs`` in 0.19 (`packed_seq_params_fields`; filled by
  `megatron_packing.megatron.packed_seq.packed_seq_params`).

The other ``megatron.training`` functions the entry point's loop calls (``training_log``,
``checkpoint_and_decide_exit``, ``post_training_step_callbacks``, ``save_checkpoint`` /
``load_checkpoint``, ``save_checkpoint_and_time``, the rerun state machine, the schedules) take
the arguments the loop passes in both releases; 0.19's additions are optional keywords.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

# [lowest, highest) megatron-core (major, minor) this library supports; tested: 0.16.1, 0.19.2.
SUPPORTED_FROM = (0, 16)
SUPPORTED_BELOW = (0, 20)
SUPPORTED_TEXT = ">= 0.16, < 0.20 (tested: 0.16.1 on Python 3.11, 0.19.2 on Python 3.12)"
# The first release whose wheel ships megatron.training (Megatron-LM's training package).
TRAINING_IN_WHEEL = (0, 19)


class UnsupportedMegatronCore(SystemExit):
    """The installed megatron-core is outside the supported range.

    A `SystemExit` (status 2): raised while the entry point is imported, it ends the process
    with its message and no traceback.
    """

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def megatron_core_version() -> tuple[int, int, int]:
    """(major, minor, patch) of the megatron-core that ``import megatron.core`` finds (a
    checkout on ``PYTHONPATH`` included), from its ``package_info``."""
    from megatron.core import package_info

    return int(package_info.MAJOR), int(package_info.MINOR), int(package_info.PATCH)


def version_text(version: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in version)


def unsupported_reason(version: tuple[int, int, int]) -> str | None:
    """Why ``version`` is refused, or None when it is in the supported range."""
    if SUPPORTED_FROM <= tuple(version[:2]) < SUPPORTED_BELOW:
        return None
    return (f"megatron-core {version_text(version)} is not supported; this megatron_packing "
            f"supports megatron-core {SUPPORTED_TEXT}. Install a supported release "
            "(pip install 'megatron-core>=0.16,<0.20'; 0.19 needs Python >= 3.12)")


def refuse_unsupported_megatron_core() -> None:
    """End the process (status 2, one line on global rank 0's stderr, no traceback) when the
    installed megatron-core is outside the supported range; otherwise do nothing."""
    reason = unsupported_reason(megatron_core_version())
    if reason is None:
        return
    message = f"megatron_packing.megatron_lm: error: {reason}"
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)
    raise UnsupportedMegatronCore(message)


def ships_training(version: tuple[int, int, int] | None = None) -> bool:
    """Whether this megatron-core's wheel carries ``megatron.training`` (0.19 and newer)."""
    found = megatron_core_version() if version is None else version
    return tuple(found[:2]) >= TRAINING_IN_WHEEL


def missing_training_message(version: tuple[int, int, int]) -> str:
    """What to do when ``megatron.training`` cannot be imported."""
    return (f"megatron.training is not importable with megatron-core {version_text(version)}: "
            "its wheel has no Megatron-LM training package. Put a Megatron-LM checkout of the "
            f"same release (tag core_v{version_text(version[:2])}.x) on PYTHONPATH, or install "
            "megatron-core 0.19 (Python >= 3.12), whose wheel ships megatron.training")


def parse_and_initialize(extra_args_provider: Callable, *, allow_no_cuda: bool,
                         check: Callable[[Any], None]) -> None:
    """Parse Megatron's arguments with ``extra_args_provider``, hand the parsed (not yet
    validated) namespace to ``check`` (start-up refusals, before anything is built), then
    validate, set Megatron's globals and run ``initialize_megatron``."""
    from megatron.training import arguments, initialize

    check(arguments.parse_args(extra_args_provider=extra_args_provider))
    if hasattr(arguments, "parse_and_validate_args"):  # 0.19: parsing is the caller's
        arguments.parse_and_validate_args(extra_args_provider=extra_args_provider)
        initialize.initialize_megatron(allow_no_cuda=allow_no_cuda)
    else:  # 0.16: initialize_megatron parses, validates and sets the globals
        initialize.initialize_megatron(extra_args_provider=extra_args_provider,
                                       allow_no_cuda=allow_no_cuda)


def setup_model_and_optimizer(model_provider: Callable, model_type: Any,
                              checkpointing_context: dict[str, Any]) -> Any:
    """Megatron's ``setup_model_and_optimizer`` (whose first two parameters swapped places in
    0.19), called by keyword: (model chunks, optimizer, scheduler)."""
    from megatron.training import training

    return training.setup_model_and_optimizer(model_provider_func=model_provider,
                                              model_type=model_type,
                                              checkpointing_context=checkpointing_context)


def thd_cp_slicer() -> Callable | None:
    """megatron-core's THD context-parallel slicer with explicit sizes,
    ``(batch, cu_seqlens, cu_seqlens_padded, max_seqlen, cp_size=, cp_rank=) -> (batch,
    PackedSeqParams)``, where this release has one (0.16); None otherwise (0.19), where the
    library's own split, Transformer Engine's convention, is used."""
    from megatron.core import utils

    return getattr(utils, "get_thd_batch_on_this_cp_rank", None)


def packed_seq_params_fields() -> frozenset[str]:
    """The field names of this megatron-core's ``PackedSeqParams``."""
    import dataclasses

    from megatron.core.packed_seq_params import PackedSeqParams

    return frozenset(field.name for field in dataclasses.fields(PackedSeqParams))
