"""One way to load a config's ``data:`` section, shared by every job and by ``prepare``.

The length-index cache key covers the data, the tokenizer and the tokenization options
(``loss_on``, ...), so a cache built ahead of a job (``megatron-packing prepare``) is hit only
when the job loads with the same options: the demo trainer, the Megatron-LM entry point and
``prepare`` all call `load_data_split`, so their argument lists cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from megatron_packing.config.training import DataConfig


def load_data_split(data: DataConfig, paths: Sequence[str], *,
                    resolve: Callable[[str], str] = str, num_proc: int | None = None,
                    show_progress: bool = False, build_sharers: int | None = None) -> Any:
    """``paths`` (``data.paths`` or ``data.valid_paths``) as an `SFTDataset`, through the
    length-index cache in ``data.cache_dir``; ``resolve`` makes the config's paths usable
    (the demo trainer's base directory). ``num_proc``, ``show_progress`` and
    ``build_sharers`` (the processes loading it at once; default ``$WORLD_SIZE``) are not part
    of the cache key."""
    from megatron_packing.data import load_sft_dataset

    return load_sft_dataset([resolve(p) for p in paths], resolve(data.tokenizer),
                            loss_on=data.loss_on, on_bad_record=data.on_bad_record,
                            cache_dir=resolve(data.cache_dir) if data.cache_dir else None,
                            num_proc=num_proc, show_progress=show_progress,
                            build_sharers=build_sharers)


__all__ = ["load_data_split"]
