"""Registers the shared data fixture of the Megatron-LM tests (helpers live in megatron_lm_runs)."""

from megatron_lm_runs import sft_data  # noqa: F401
