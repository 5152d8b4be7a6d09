"""``python -m megatron_packing.megatron_lm``: see `megatron_packing.megatron_lm.entry`."""

import sys

from megatron_packing.megatron_lm.entry import run

if __name__ == "__main__":
    sys.exit(run())
