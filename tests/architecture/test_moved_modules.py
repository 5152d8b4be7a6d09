"""An old module path fails naming its new module; every new module exists."""

from __future__ import annotations

import importlib

import pytest

from megatron_packing.common.moved_modules import MOVED_MODULES


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_module_path_is_refused_naming_the_new_one(old):
    new = MOVED_MODULES[old]
    with pytest.raises(ModuleNotFoundError, match=rf"{old} has moved: import {new} instead"):
        importlib.import_module(old)
    importlib.import_module(new)  # the new path really exists


def test_a_module_that_never_existed_fails_as_python_says():
    with pytest.raises(ModuleNotFoundError, match="No module named"):
        importlib.import_module("megatron_packing.no_such_module")


def test_no_old_path_shadows_a_real_module():
    for old in MOVED_MODULES:
        assert importlib.util.find_spec(old.rsplit(".", 1)[0]) is not None  # parent exists
        with pytest.raises(ModuleNotFoundError):
            importlib.util.find_spec(old)
