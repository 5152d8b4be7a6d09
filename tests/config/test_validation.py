"""The shared value checks: what they accept, and errors that name the setting and the range."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_packing.common.validation import (
    ConfigError,
    require_bool,
    require_choice,
    require_int,
    require_number,
    require_positive_int,
)


def test_integers_numpy_included_bools_refused():
    assert require_int("steps", np.int64(3), minimum=1) == 3
    assert type(require_int("steps", np.int32(3))) is int
    assert require_int("steps", None, allow_none=True) is None
    with pytest.raises(ConfigError, match=r"steps must be an integer >= 1, got True"):
        require_int("steps", True, minimum=1)
    with pytest.raises(ConfigError, match=r"steps must be an integer >= 1, got 0"):
        require_positive_int("steps", 0)
    with pytest.raises(ConfigError, match=r"rank must be an integer in \[0, 3\], got 4"):
        require_int("rank", 4, minimum=0, maximum=3)
    with pytest.raises(ConfigError, match=r"or None, got 2.5"):
        require_int("budget", 2.5, allow_none=True)
    with pytest.raises(TypeError):
        require_int("x", "a", error=TypeError)


def test_numbers_and_open_intervals():
    assert require_number("v", 0.05, minimum=0, maximum=1, exclusive=True) == 0.05
    assert require_number("k", np.float32(2.0), minimum=0) == 2.0
    for bad in (0, 1, float("nan"), "0.1", False):
        with pytest.raises(ConfigError, match=r"v must be a number in \(0, 1\)"):
            require_number("v", bad, minimum=0, maximum=1, exclusive=True)
    with pytest.raises(ConfigError, match=r"k must be a number >= 0, got -1"):
        require_number("k", -1, minimum=0)
    with pytest.raises(ConfigError, match=r"lr must be a number > 0, got 0"):
        require_number("lr", 0, minimum=0, exclusive=True)
    with pytest.raises(ConfigError, match=r"p must be a number <= 1, got 2"):
        require_number("p", 2, maximum=1)


def test_bools_and_choices():
    assert require_bool("flag", np.bool_(True)) is True
    for bad in ("true", 1, None):
        with pytest.raises(ConfigError, match="flag must be true or false"):
            require_bool("flag", bad)
    assert require_choice("algorithm", "ffd", ("mffd", "ffd")) == "ffd"
    with pytest.raises(ConfigError, match=r"algorithm must be one of mffd, ffd; got 'bfdd'"):
        require_choice("algorithm", "bfdd", ("mffd", "ffd"))
