"""The CPU demo trainer: ``megatron-packing train --config``, apart from the library.

It hosts the library's loader on a tiny megatron-core GPT with its own launcher, checkpoints
and run-directory rules. Nothing in the library imports from here.
"""
