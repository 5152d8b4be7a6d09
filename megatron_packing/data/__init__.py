"""SFT data: chat/instruction records -> token ids + loss masks, with a cached length index.

Public names: :func:`load_sft_dataset`, :class:`SFTDataset`, :func:`save_pretokenized`,
:func:`load_length_index`, :class:`BadRecordError`.
"""

from __future__ import annotations

from .dataset import SFTDataset
from .errors import LOSS_ON_CHOICES, ON_BAD_RECORD_CHOICES, REASONS, BadRecordError
from .length_index import LengthIndex, default_cache_dir, load_length_index
from .load import load_sft_dataset
from .pretokenized import save_pretokenized
from .store import CorruptStoreError

__all__ = [
    "LOSS_ON_CHOICES",
    "ON_BAD_RECORD_CHOICES",
    "REASONS",
    "BadRecordError",
    "CorruptStoreError",
    "LengthIndex",
    "SFTDataset",
    "default_cache_dir",
    "load_length_index",
    "load_sft_dataset",
    "save_pretokenized",
]
