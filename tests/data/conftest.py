"""Registers the data tests' fixtures; helpers live in sft_test_data."""

from sft_test_data import chat_file, real_tok, tok, tok_plain  # noqa: F401
