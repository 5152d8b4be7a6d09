"""Test launcher: the Megatron-LM entry point with the CPU shims applied (``torchrun run_cpu.py``).

``MEGATRON_PACKING_JOB_STARTED_S_AGO`` says how long ago the job started, for
``--exit-duration-in-mins`` (a job whose clock is already near its limit).
``MEGATRON_PACKING_TEST_FLOAT64=1`` builds the model in float64 (Megatron has no flag for it):
equivalence tests then compare sums whose rounding is far below their tolerance. The ``__main__``
guard matters: torch_dist's checkpoint writer starts helper processes that re-import this file.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def run() -> int:
    import cpu_shims

    cpu_shims.apply()
    if os.environ.get("MEGATRON_PACKING_TEST_FLOAT64") == "1":
        _params_in_float64()
    from megatron_packing.megatron_lm.entry import run as run_entry

    started_ago = float(os.environ.get("MEGATRON_PACKING_JOB_STARTED_S_AGO", "0"))
    return run_entry(program_start=time.time() - started_ago if started_ago else None)


def _params_in_float64() -> None:
    import torch
    from megatron.training import initialize

    validate = initialize.validate_args

    def validate_then_float64(args, defaults=None):
        validate(args, defaults or {})
        args.params_dtype = torch.float64

    initialize.validate_args = validate_then_float64

    import model_provider  # Megatron-LM's; the entry point imports its function at start-up

    build = model_provider.model_provider

    def build_in_float64(*args, **kwargs):
        return build(*args, **kwargs).double()

    model_provider.model_provider = build_in_float64


if __name__ == "__main__":
    sys.exit(run())
