"""Megatron-LM entry point: ``python -m megatron_packing.megatron_lm`` (see `entry`).

Modules: `arguments` (added arguments, start-up refusals), `data` (per-rank loaders and their
state in Megatron's checkpoints), `forward` (one packed row through the model), `loop` (the
step loop with a per-step micro-batch count), `entry` (``main``).
"""
