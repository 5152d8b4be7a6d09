"""Test launcher: the Megatron-LM entry point with the CPU shims applied (``torchrun run_cpu.py``).

``MEGATRON_PACKING_JOB_STARTED_S_AGO`` says how long ago the job started, for
``--exit-duration-in-mins`` (a job whose clock is already near its limit).
``MEGATRON_PACKING_TEST_HIDE_HELPERS=1`` makes megatron-core's compiled dataset helpers fail to
import, as on an install without them. ``MEGATRON_PACKING_TEST_FLOAT64=1`` builds the model in
float64 (Megatron has no flag for it): equivalence tests then compare sums whose rounding is far
below their tolerance. The ``__main__`` guard matters: torch_dist's checkpoint writer starts
helper processes that re-import this file.

A rank that returns ends without the interpreter's teardown of torch's and Megatron's modules
(about 1.5 s of each launch on 2 cores): the exit handlers run and the output is flushed first.
``MEGATRON_PACKING_TEST_FULL_EXIT=1`` keeps the whole teardown, as ``python -m
megatron_packing.megatron_lm`` has it; the launches of ``test_graceful_stops.py`` and
``test_startup.py`` set it, so a rank that hangs or fails while it tears down fails a test.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The second stack holds nvidia-modelopt for the Bridge tier (Bridge imports it at module top).
# Megatron-LM's checkpointing imports it whenever it is installed, about 7 s of every rank's start
# on 2 cores, and these runs use none of it: they see it absent, as an install without it does.
sys.modules.setdefault("modelopt", None)  # type: ignore[assignment]


def run() -> int:
    from megatron_packing.megatron_lm.__main__ import start

    start(sys.argv[1:])  # as `python -m megatron_packing.megatron_lm`: before Megatron's imports
    import cpu_shims

    if os.environ.get("MEGATRON_PACKING_TEST_HIDE_HELPERS") == "1":
        sys.modules["megatron.core.datasets.helpers_cpp"] = None  # as if they did not import
    cpu_shims.apply()
    if os.environ.get("MEGATRON_PACKING_TEST_FLOAT64") == "1":
        _params_in_float64()
    from megatron_packing.megatron_lm.entry import run as run_entry

    started_ago = float(os.environ.get("MEGATRON_PACKING_JOB_STARTED_S_AGO", "0"))
    return run_entry(program_start=time.time() - started_ago if started_ago else None)


def _params_in_float64() -> None:
    import torch
    from megatron.training import arguments, initialize

    # megatron-core 0.16 validates inside initialize_megatron, 0.19 in parse_and_validate_args.
    where = initialize if hasattr(initialize, "validate_args") else arguments
    validate = where.validate_args

    def validate_then_float64(args, defaults=None):
        validate(args, defaults or {})
        args.params_dtype = torch.float64

    where.validate_args = validate_then_float64

    def in_float64(build):
        def build_in_float64(*args, **kwargs):
            return build(*args, **kwargs).double()

        return build_in_float64

    # Both providers: the entry point looks each up when it builds the model.
    from megatron_packing.megatron_lm import model

    model.gpt_model_provider = in_float64(model.gpt_model_provider)
    try:
        import model_provider  # a Megatron-LM checkout's
    except ImportError:
        return
    model_provider.model_provider = in_float64(model_provider.model_provider)


def _exit(code: int) -> None:
    if os.environ.get("MEGATRON_PACKING_TEST_FULL_EXIT") == "1":
        sys.exit(code)
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(run())
