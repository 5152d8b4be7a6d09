"""The cluster-scale launches (issue-scale data and nodes, simulated on one host): a length
index built inside a job for longer than the process group's timeout, and two torchrun
launchers as two nodes. They drive the Megatron-LM entry point under torchrun with the helpers
of ``tests/megatron_lm`` (``megatron_lm_runs``), but what they test is the data build and the
rendezvous, not Megatron-LM's loop, so they are a tier of their own: the Megatron-LM tier stays
short, and the second stack (``scripts/test_stack312.sh``) does not repeat them."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron_lm"))

from megatron_lm_runs import sft_data  # noqa: E402, F401
