"""Test launcher: the Megatron-LM entry point with the CPU shims applied (``torchrun run_cpu.py``).

``MEGATRON_PACKING_JOB_STARTED_S_AGO`` says how long ago the job started, for
``--exit-duration-in-mins`` (a job whose clock is already near its limit). The ``__main__``
guard matters: torch_dist's checkpoint writer starts helper processes that re-import this file.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def run() -> int:
    import cpu_shims

    cpu_shims.apply()
    from megatron_packing.megatron_lm.entry import run as run_entry

    started_ago = float(os.environ.get("MEGATRON_PACKING_JOB_STARTED_S_AGO", "0"))
    return run_entry(program_start=time.time() - started_ago if started_ago else None)


if __name__ == "__main__":
    sys.exit(run())
