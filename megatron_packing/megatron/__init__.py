"""Glue between packed batches and megatron-core / Megatron-LM."""
