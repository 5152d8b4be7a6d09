"""Megatron-LM entry point: ``python -m megatron_packing.megatron_lm`` (see `entry`).

Modules: `arguments` (added arguments, start-up refusals), `argument_policy` (every Megatron-LM
argument the loop reads: honoured or refused), `data` (per-rank loaders and their state in
Megatron's checkpoints), `forward` (one packed row through the model), `step` (one optimizer
step at this step's micro-batch count), `evaluation` (validation on the validation loader),
`loop` (Megatron-LM's loop pieces around the step), `entry` (``main``).
"""
