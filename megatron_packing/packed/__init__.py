"""Packed mode: the DP-aligned step sampler and the THD collator."""
