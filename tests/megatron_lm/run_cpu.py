"""Test launcher: the Megatron-LM entry point with the CPU shims applied (``torchrun run_cpu.py``)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cpu_shims  # noqa: E402

cpu_shims.apply()

from megatron_packing.megatron_lm.entry import main  # noqa: E402

sys.exit(main())
