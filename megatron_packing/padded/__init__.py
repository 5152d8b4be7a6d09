"""Padded mode: token-budget micro-batches of [b, L] rows, kept in lockstep across ranks."""
