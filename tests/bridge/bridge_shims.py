"""Test support: what Megatron-Bridge 0.6.2 needs to import and train on a CPU-only torch build.

The tests drive Bridge's own ``pretrain()`` / ``setup()`` / ``train_step`` / checkpointing on CPU
with gloo; every place where Bridge (or megatron-core under it) assumes a GPU or Transformer Engine
is answered here, from outside (nothing under site-packages is edited). Paths are relative to
``site-packages/megatron/``. Each entry names the line it gets past; its last line names the GPU
code path it stands in for.

Imports (`install_import_shims`; served only for packages that are really absent):

1. TE for one importer: ``bridge/peft/lora_layers.py`` line 20 ``import transformer_engine.pytorch
   as te`` (reached by ``import megatron.bridge`` through models -> conversion -> peft). The module
   evaluates ``te.ops.Sequential`` in annotations at import and tests ``isinstance(x, te.Linear)``
   when LoRA wraps a layer; the stand-in's names are classes no object is an instance of, and
   calling one raises.
   GPU: TE's fused LoRA branches (``LoRALinear._make_fused_branches``), unused here.
2. NVRx for one importer: ``bridge/training/pretrain.py`` line 19 ``from
   nvidia_resiliency_ext.inprocess import CallWrapper`` (only the annotation of ``_pretrain``).
   GPU: in-process restart (``cfg.inprocess_restart``), which imports NVRx itself
   (``training/inprocess_restart.py``) and still fails without it.

   Both are served by a ``sys.meta_path`` finder that wraps the loader of exactly those two
   modules: while one of them executes, its ``__builtins__.__import__`` answers the stand-ins for
   those names; nothing enters ``sys.modules``, so ``importlib.util.find_spec("transformer_engine")``
   and ``find_spec("nvidia_resiliency_ext")`` stay None and megatron-core's own TE probes
   (``HAVE_TE``, ``is_te_min_version``) still see no TE. Any other importer of them still fails.

Runtime (`apply`; only where ``torch.cuda.is_available()`` is False):

3. ``bridge/training/initialize.py`` ``initialize_megatron`` line 91 ``assert
   torch.cuda.is_available(), "Megatron requires CUDA."``: ``setup()`` (``setup.py`` line 253)
   passes no ``allow_no_cuda``; the shim passes ``allow_no_cuda=True`` (bound in ``initialize``
   and ``setup``).
   GPU: the assertion holds.
4. ``initialize.py`` ``initialize_megatron`` line 147 ``compile_helpers()``: megatron-core's
   ``datasets/utils.py`` ``compile_helpers`` runs ``make`` in the wheel's ``core/datasets``, which
   has no Makefile, and calls ``sys.exit(1)``. A no-op only when
   ``megatron.core.datasets.helpers_cpp`` imports (the wheel ships it built).
   GPU: the same call, and the same failure with the wheel (a GPU host needs this too).
5. The tensor-parallel RNG tracker: ``initialize.py`` ``_set_random_seed`` line 869 seeds it
   (``model_parallel_cuda_manual_seed``) only when ``torch.cuda.device_count() > 0``. Without it
   weight init stops at ``core/tensor_parallel/layers.py`` ``_initialize_affine_weight_gpu``
   (``fork()``: "cuda rng state model-parallel-rng is not added"), and the project's CPU answer
   (``apply_cpu_workarounds``' inference tracker) keeps no states, so Bridge's checkpoint load
   stops at ``training/checkpointing.py`` ``_load_checkpoint_from_path`` line 3157 (empty
   ``rng_tracker_states`` -> ``KeyError`` -> ``sys.exit()`` at line 3181, exit status 0). The shim
   installs `CpuRNGStatesTracker` (megatron-core's tracker with the CPU generator in the device
   generator's place) and lets Bridge's own ``_set_random_seed`` seed it, answering
   ``device_count() == 1`` for that call only; TP-region dropout then draws from saved, restored
   named states, so a resumed run repeats the uninterrupted one bit for bit. With
   ``cfg.rng.inference_rng_tracker`` the project's inference tracker is used as before.
   GPU: ``model_parallel_cuda_manual_seed`` on the device generator.
6. Optimizer tensors and CUDA type names: ``megatron_optimizer_compat`` (project,
   ``megatron_packing/megatron/cpu_workarounds.py``) around ``setup.setup_optimizer`` (Bridge's
   ``training/optim.py`` -> ``get_megatron_optimizer``) and every ``optimizer.step()`` Bridge's
   ``train_step`` makes: first stop without it ``core/optimizer/clip_grads.py``
   ``clip_grad_by_total_norm_fp32`` line 174 ``assert param.grad.type() ==
   'torch.cuda.FloatTensor'`` (also the distributed optimizer's ``param.type()`` branch and its
   CUDA loss-scale / found-inf tensors).
   GPU: the tensors' own CUDA names and devices; the compat mode is not entered.
7. ``tests/megatron_lm/cpu_shims.apply()`` (project, reused whole):
   a. ``cuda_factories_on_cpu`` for the process: ``device="cuda"`` factories in
      ``initialize.py`` ``_warmup_jit_function`` line 895 (first stop), ``setup.py`` line 281
      (start-time all-reduce), ``bridge/data/loaders.py`` line 406 (do_train flags),
      ``training/utils/train_utils.py`` (loss and norm accumulators).
   b. ``torch.cuda`` and ``.cuda()``: ``core/timers.py`` ``Timer.start`` line 152
      ``torch.cuda.synchronize()`` (first stop: ``setup.py`` line 292), ``current_device`` /
      ``Module.cuda`` in ``bridge/models/model_provider.py`` line 689, ``Tensor.cuda`` in
      ``training/gpt_step.py`` ``get_batch_from_iterator`` line 266, streams in megatron-core's
      DDP, ``torch.cuda.get_rng_state`` in ``checkpointing.py`` ``get_rng_state`` line 491 (the CPU
      generator's state is saved there; restoring it is a no-op, ``torch_rng_state`` restores it).
   Its Megatron-LM parts (``megatron.training.initialize`` / ``arguments``, the MoE router name)
   are never reached by Bridge.
   GPU: the device's own calls; covered for the project by tests/gpu/test_gpu_workarounds.py.

Needed nowhere: gloo accepts ``initialize.py`` line 756 ``barrier(device_ids=[local_rank])``;
megatron-core's DDP runs on gloo as is.
Not answered: ``use_distributed_optimizer`` with a checkpoint *load* stops at
``core/optimizer/distrib_optimizer.py`` ``state_dict`` line 839 (``assert len(steps) == 1``: torch's
Adam, the fallback without Apex/TE, has no state before its first step), the limitation the
project's Megatron-LM path already refuses; saving and training work.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

_MEGATRON_LM_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron_lm")

#: Bridge module -> the absent packages its top-level code imports (shims 1 and 2).
STUBBED_IMPORTS: dict[str, tuple[str, ...]] = {
    "megatron.bridge.peft.lora_layers": ("transformer_engine", "transformer_engine.pytorch"),
    "megatron.bridge.training.pretrain": ("nvidia_resiliency_ext", "nvidia_resiliency_ext.inprocess"),
}


class _StandInMeta(type):
    """Any attribute of a stand-in class is another stand-in class; calling one raises."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        child = _StandInMeta(name, (), {"__module__": cls.__module__,
                                        "__qualname__": f"{cls.__qualname__}.{name}"})
        setattr(cls, name, child)
        return child

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{cls.__module__}.{cls.__qualname__}: a CPU test stand-in "
                           "(tests/bridge/bridge_shims.py); the package is not installed")


def _stand_in_modules(names: tuple[str, ...]) -> dict[str, types.ModuleType]:
    modules: dict[str, types.ModuleType] = {}
    for name in names:
        module = types.ModuleType(name, "CPU test stand-in (tests/bridge/bridge_shims.py)")

        def getattr_(attr: str, _module: str = name) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _StandInMeta(attr, (), {"__module__": _module, "__qualname__": attr})

        module.__getattr__ = getattr_  # type: ignore[method-assign]
        modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    return modules


class _StandInLoader(importlib.abc.Loader):
    """Runs the real loader with an ``__import__`` that answers the stand-ins while the module
    body executes (its own import statements only; nothing goes into ``sys.modules``)."""

    def __init__(self, real: Any, names: tuple[str, ...]) -> None:
        self.real = real
        self.names = names

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tracebacks
        return getattr(self.real, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        stand_ins = _stand_in_modules(self.names)
        real_import = builtins.__import__
        executing = True

        def import_(name: str, globals_: Any = None, locals_: Any = None, fromlist: Any = (),
                    level: int = 0) -> Any:
            if executing and level == 0 and name in stand_ins:
                return stand_ins[name] if fromlist else stand_ins[name.partition(".")[0]]
            return real_import(name, globals_, locals_, fromlist, level)

        module.__dict__["__builtins__"] = {**vars(builtins), "__import__": import_}
        try:
            self.real.exec_module(module)
        finally:
            executing = False
            module.__dict__["__builtins__"] = builtins


class _StandInFinder(importlib.abc.MetaPathFinder):
    def __init__(self, stubbed: dict[str, tuple[str, ...]]) -> None:
        self.stubbed = stubbed

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        names = self.stubbed.get(fullname)
        if names is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _StandInLoader(spec.loader, names)
        return spec


def install_import_shims() -> None:
    """Shims 1 and 2: ``import megatron.bridge`` and ``megatron.bridge.training.pretrain`` without
    Transformer Engine / NVRx. Only packages that are absent get a stand-in. Idempotent."""
    if any(isinstance(finder, _StandInFinder) for finder in sys.meta_path):
        return
    stubbed = {module: names for module, names in STUBBED_IMPORTS.items()
               if importlib.util.find_spec(names[0]) is None}
    if stubbed:
        sys.meta_path.insert(0, _StandInFinder(stubbed))


def _cpu_rng_tracker_class() -> type:
    from megatron.core.tensor_parallel.random import (
        _MODEL_PARALLEL_RNG_TRACKER_NAME,
        CudaRNGStatesTracker,
    )

    class CpuRNGStatesTracker(CudaRNGStatesTracker):
        """Shim 5: megatron-core's tracker with the CPU default generator in the device
        generator's place: ``add`` seeds a named state, ``fork`` swaps it in and back out."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            original = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(original)

        @contextlib.contextmanager
        def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            original, original_name = torch.get_rng_state(), self._current_state_name
            if original_name != "default-rng":
                self.states_[original_name] = original
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if original_name != "default-rng":
                    original = self.states_[original_name]
                torch.set_rng_state(original)
                self._current_state_name = original_name

    return CpuRNGStatesTracker


def _install_cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._CUDA_RNG_STATE_TRACKER = _cpu_rng_tracker_class()()
    tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


@contextlib.contextmanager
def _one_device_counted() -> Iterator[None]:
    device_count = torch.cuda.device_count
    torch.cuda.device_count = lambda: 1  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.device_count = device_count  # type: ignore[assignment]


def _megatron_lm_cpu_shims() -> Any:
    if _MEGATRON_LM_TESTS not in sys.path:
        sys.path.insert(0, _MEGATRON_LM_TESTS)
    import cpu_shims

    return cpu_shims


_APPLIED: list[bool] = []


def apply() -> None:
    """All shims: the import shims (1, 2) always, the runtime shims (3 to 7) only where
    ``torch.cuda.is_available()`` is False. Call before Bridge's ``setup()`` / ``pretrain()``.
    Idempotent."""
    install_import_shims()
    if torch.cuda.is_available() or _APPLIED:
        return
    _APPLIED.append(True)
    _megatron_lm_cpu_shims().apply()  # 7

    from megatron.bridge.training import initialize, optim, setup

    from megatron_packing.megatron.cpu_workarounds import (
        apply_cpu_workarounds,
        megatron_optimizer_compat,
    )

    original_initialize = initialize.initialize_megatron

    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:  # 3
        kwargs["allow_no_cuda"] = True
        return original_initialize(*args, **kwargs)

    initialize.initialize_megatron = initialize_megatron
    setup.initialize_megatron = initialize_megatron

    try:  # 4
        import megatron.core.datasets.helpers_cpp  # noqa: F401
    except ImportError:
        pass
    else:
        initialize.compile_helpers = lambda: None

    original_seed = initialize._set_random_seed

    def set_random_seed(*args: Any, **kwargs: Any) -> None:  # 5
        inference = kwargs.get("inference_rng_tracker", args[3] if len(args) > 3 else False)
        if inference:
            original_seed(*args, **kwargs)
            apply_cpu_workarounds()
            return
        _install_cpu_rng_tracker()
        with _one_device_counted():
            original_seed(*args, **kwargs)

    initialize._set_random_seed = set_random_seed

    original_setup_optimizer = optim.setup_optimizer

    def setup_optimizer(*args: Any, **kwargs: Any) -> Any:  # 6
        with megatron_optimizer_compat():
            optimizer, scheduler = original_setup_optimizer(*args, **kwargs)
        step = optimizer.step

        def step_compat(*step_args: Any, **step_kwargs: Any) -> Any:
            with megatron_optimizer_compat():
                return step(*step_args, **step_kwargs)

        optimizer.step = step_compat
        return optimizer, scheduler

    optim.setup_optimizer = setup_optimizer
    setup.setup_optimizer = setup_optimizer
