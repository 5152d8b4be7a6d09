"""Checks on a saved sampler state before it is loaded: present, complete, same setup.

Loading a wrong state must never restart a run silently at step 0 or continue it in another
order: both checks raise a `ValueError` that names what is missing or which setting differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def check_state_keys(state: Any, required: Sequence[str], owner: str) -> None:
    """Refuse a missing, empty or partial state instead of silently restarting at step 0."""
    where = (f"pass the dict that {owner}.state_dict() returned (in a loader checkpoint it is "
             "inside StatefulDataLoader.state_dict()); to start from the beginning, do not load "
             "a state at all")
    if not isinstance(state, dict):
        shown = "None" if state is None else f"a {type(state).__name__}"
        raise ValueError(f"{owner}.load_state_dict got {shown}, not a sampler state: {where}")
    missing = [key for key in required if key not in state]
    if missing:
        what = "an empty dict" if not state else f"a dict without {', '.join(missing)}"
        raise ValueError(f"{owner}.load_state_dict got {what}, not a sampler state "
                         f"(expected keys: {', '.join(required)}): {where}")


def check_fingerprint(saved: Any, current: dict[str, Any]) -> None:
    """Refuse a state saved under other settings, naming each field with both values."""
    if not isinstance(saved, dict):
        raise ValueError(f"the sampler state's fingerprint is {type(saved).__name__}, not a dict")
    differing = [
        f"{key}: saved {saved[key]!r}, now {value!r}" if key in saved
        else f"{key}: not recorded in the saved state (saved by an older version), now {value!r}"
        for key, value in current.items()
        if key not in saved or saved[key] != value
    ]
    if differing:
        raise ValueError(
            "cannot resume: the saved sampler state comes from a different setup, one that "
            "orders or plans the examples differently (" + "; ".join(differing) + "). Resume "
            "with the saved settings, or start a new run without loading this state"
        )
