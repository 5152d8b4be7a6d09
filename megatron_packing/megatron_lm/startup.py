"""Megatron-LM's compile step at start-up, as an installed megatron-core needs it.

``initialize_megatron`` ends in ``_compile_dependencies``:

* the dataset helpers: ``compile_helpers`` runs make on global rank 0 (0.16 and 0.19); the
  wheels ship the helpers prebuilt and no Makefile, so that make fails and the other ranks wait
  in the next barrier. `prepare_compile_step` checks the helpers on every rank first
  (`megatron_packing.megatron.dataset_helpers`) and has make run only where they do not import;
* the legacy fused kernels (Megatron-LM 0.16's ``megatron.legacy.fused_kernels.load``): it reads
  the CUDA toolkit's ``nvcc -V`` to choose architecture flags and, in core_v0.16.1, compiles no
  kernel. Without a toolkit (a CPU machine, or a GPU machine with pip's CUDA runtime and no
  nvcc) it fails on the missing path; there the load is skipped with one line, and it runs
  unchanged wherever nvcc exists. 0.19 has no such step.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

from megatron_packing.megatron.dataset_helpers import ensure_dataset_helpers, use_prebuilt_helpers


def nvcc_path() -> str | None:
    """The CUDA toolkit's nvcc that torch's extension builder would use, or None."""
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if not home:
        return None
    path = os.path.join(home, "bin", "nvcc")
    return path if os.path.isfile(path) else None


def fused_kernels_load_without_toolkit(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """Megatron-LM's legacy fused-kernel ``load``, skipped (one line) where there is no nvcc."""

    def load(args: Any) -> None:
        if nvcc_path() is not None:
            original(args)
            return
        if getattr(args, "rank", 0) == 0:
            print("> no CUDA toolkit (nvcc) found: Megatron-LM's legacy fused-kernel loader, "
                  "which only reads nvcc's version here, is skipped", flush=True)

    load.__wrapped__ = original  # type: ignore[attr-defined]
    return load


def prepare_compile_step(report: Callable[[str], None] | None = None) -> None:
    """Before ``initialize_megatron``, on every rank: the dataset helpers import or are built
    (else `DatasetHelpersUnavailable`), and Megatron's compile step will not run make or need
    nvcc for what this release does not build."""
    ensure_dataset_helpers(report)
    use_prebuilt_helpers()
    try:
        fused_kernels = importlib.import_module("megatron.legacy.fused_kernels")
    except ImportError:  # 0.19's megatron.training has no legacy loader
        return
    current = getattr(fused_kernels, "load", None)
    if current is not None and getattr(current, "__wrapped__", None) is None:
        setattr(fused_kernels, "load", fused_kernels_load_without_toolkit(current))  # noqa: B010


__all__ = ["prepare_compile_step"]
