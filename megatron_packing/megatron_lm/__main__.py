"""``python -m megatron_packing.megatron_lm``: see `megatron_packing.megatron_lm.entry`.

`start` runs before Megatron is imported: global rank 0 prints the program's first line, and
the known harmless third-party start-up warnings collapse into one line
(`megatron_packing.common.quiet_start`; ``--packing-verbose`` or ``PYTHONWARNINGS`` shows them).
"""

import os
import sys
from collections.abc import Sequence

from megatron_packing.common import quiet_start

VERBOSE_FLAG = "--packing-verbose"


def start(argv: Sequence[str]) -> None:
    """The first line and the quiet start of one rank process, before any heavy import."""
    world = os.environ.get("WORLD_SIZE", "1")
    quiet_start.begin(f"megatron_packing.megatron_lm: starting Megatron-LM on {world} "
                      f"rank{'' if world == '1' else 's'}", verbose=VERBOSE_FLAG in argv,
                      verbose_flag=VERBOSE_FLAG)


if __name__ == "__main__":
    start(sys.argv[1:])
    from megatron_packing.megatron_lm.entry import run

    sys.exit(run())
