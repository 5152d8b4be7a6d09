"""Checks on a saved sampler state before it is loaded: present, the right mode, complete,
every field of its type and range, same setup.

Loading a wrong state must never restart a run silently at step 0, continue it in another
order, or fail later on a tampered value: each check raises a `ValueError` that names what is
missing, which field is out of range, or which setting differs.
"""

from __future__ import annotations

import hashlib
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

MODE_MARKS = {
    "packed": ("DPAlignedPackingBatchSampler", ("carry", "drift", "step_in_epoch"),
               "use_sequence_packing: true"),
    "padded": ("TokenBudgetBatchSampler", ("max_tokens", "budget_changes"),
               "use_sequence_packing: false"),
}
"""Each mode's sampler, the state keys only it writes, and the setting that selects it."""


def check_state_keys(state: Any, required: Sequence[str], owner: str) -> None:
    """Refuse a missing, empty or partial state instead of silently restarting at step 0; a
    state of the other mode's sampler is named as such."""
    where = (f"pass the dict that {owner}.state_dict() returned (in a loader checkpoint it is "
             "inside StatefulDataLoader.state_dict()); to start from the beginning, do not load "
             "a state at all")
    if not isinstance(state, dict):
        shown = "None" if state is None else f"a {type(state).__name__}"
        raise ValueError(f"{owner}.load_state_dict got {shown}, not a sampler state: {where}")
    for mode, (sampler, marks, setting) in MODE_MARKS.items():
        if sampler != owner and all(key in state for key in marks):
            raise ValueError(
                f"{owner}.load_state_dict got a {mode}-mode state (saved by {sampler}, "
                f"{setting}); this loader runs the other mode: resume with {setting}, or start "
                "a new run without loading this state")
    missing = [key for key in required if key not in state]
    if missing:
        what = "an empty dict" if not state else f"a dict without {', '.join(missing)}"
        raise ValueError(f"{owner}.load_state_dict got {what}, not a sampler state "
                         f"(expected keys: {', '.join(required)}): {where}")


def _same_fp8(saved: Any, now: Any) -> bool:
    """``tp_cp_fp8`` = [tp, cp, fp8_enabled, fp8_recipe]: tp and cp may change, FP8 may not."""
    return isinstance(saved, list) and isinstance(now, list) and saved[2:] == now[2:]


RESHARDABLE: dict[str, Any] = {
    "dp_size": lambda saved, now: True,
    "alignment": lambda saved, now: True,  # follows tp and cp (FP8 is checked in tp_cp_fp8)
    "tp_cp_fp8": _same_fp8,
}
"""Fingerprint fields a resume may change, each with the test of an allowed change: the
parallel layout. A sampler state is the global stream (the order's position, the carry, the step
counters, the drift), which every rank plans from alike; the layout decides only how the steps
ahead are aligned and handed out to the ranks, so the state continues under another one
(docs/sampler.md, "Resuming on another number of GPUs")."""


FINGERPRINT_NAMES: dict[str, str] = {
    "batch_size": "global_batch_size",
    "v": "packing_batch_size_allowed_variation (as v, in examples)",
    "align_to_dp": "align_packing_bins_to_dp",
    "algorithm": "packing_algorithm",
    "alignment": "the row alignment of tp_size, cp_size and fp8_recipe (its multiples)",
    "tp_cp_fp8": "tp_size, cp_size, fp8_enabled, fp8_recipe",
    "lengths_sha256": "the examples' lengths (sha256; the data or its tokenization changed)",
    "lengths_sum": "the examples' lengths (their sum; the data or its tokenization changed)",
    "num_examples": "the number of examples",
    "base_sampler": "base_order (the base sampler)",
    "eval_mode": "evaluation (a training state loaded into an evaluation loader, or back)",
}
"""Fingerprint fields under the names a user sets them by (YAML keys), for refusals; a field
not listed is named as it is (``bin_capacity``, ``seed``, ...)."""


def target_fingerprint(dataset: Any, loss_token_counts: Any) -> dict[str, Any]:
    """What decides what is trained on the examples, beside their lengths: the tokens each
    example trains on (its loss-target count, before any truncation) and, for a dataset the
    library loaded, its tokenizer and chat template, ``loss_on`` and the data as tokenized.

    A resume is refused when any of these changed (`check_fingerprint`), under the name here.
    """
    counts = np.ascontiguousarray(np.asarray(loss_token_counts), dtype=np.int64)
    out: dict[str, Any] = {
        "data.loss_on (the loss targets per example, sha256)":
            hashlib.sha256(counts.tobytes()).hexdigest()[:24]}
    options = getattr(dataset, "options", None)
    if isinstance(options, dict):
        if isinstance(options.get("tokenizer_fingerprint"), str):
            out["data.tokenizer (its vocabulary, special tokens and chat template)"] = \
                options["tokenizer_fingerprint"][:24]
        if "loss_on" in options:
            out["data.loss_on"] = options["loss_on"]
    content = getattr(dataset, "fingerprint", None)
    if isinstance(content, str):
        out["data (its files, tokenizer and tokenization options)"] = content[:24]
    return out


def check_fingerprint(saved: Any, current: dict[str, Any]) -> None:
    """Refuse a state saved under other settings, naming each field (by the key a user sets it
    with, `FINGERPRINT_NAMES`) with both values.

    The parallel layout (`RESHARDABLE`) may differ; everything else must match.
    """
    if not isinstance(saved, dict):
        raise ValueError(f"the sampler state's fingerprint is {type(saved).__name__}, not a dict")
    differing = [
        f"{FINGERPRINT_NAMES.get(key, key)}: saved {saved[key]!r}, now {value!r}" if key in saved
        else f"{FINGERPRINT_NAMES.get(key, key)}: not recorded in the saved state, now {value!r}"
        for key, value in current.items()
        if key not in saved or (saved[key] != value and not (
            key in RESHARDABLE and RESHARDABLE[key](saved[key], value)))
    ]
    if differing:
        raise ValueError(
            "cannot resume: the saved sampler state comes from a different setup, one that "
            "orders or plans the examples differently (" + "; ".join(differing) + "). Resume "
            "with the saved settings, or start a new run without loading this state"
        )


FieldRule = tuple[str, int | None]
"""(kind, minimum): kind is int, int_or_none, bool, dict, int_list or int_pairs."""


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _field_problem(value: Any, kind: str, minimum: int | None) -> str | None:
    def bounded(v: Any) -> bool:
        return _is_int(v) and (minimum is None or v >= minimum)

    floor = f" >= {minimum}" if minimum is not None else ""
    if kind == "int" and not bounded(value):
        return f"an integer{floor}"
    if kind == "int_or_none" and value is not None and not bounded(value):
        return f"an integer{floor} or None"
    if kind == "bool" and not isinstance(value, bool):
        return "True or False"
    if kind == "dict" and not isinstance(value, dict):
        return "a dict"
    if kind == "int_list" and not (isinstance(value, (list, tuple))
                                   and all(bounded(v) for v in value)):
        return f"a list of integers{floor}"
    if kind == "int_pairs" and not (isinstance(value, (list, tuple)) and all(
            isinstance(p, (list, tuple)) and len(p) == 2 and all(bounded(v) for v in p)
            for p in value)):
        return f"a list of (step, budget) integer pairs{floor}"
    return None


def check_state_fields(state: dict[str, Any], rules: dict[str, FieldRule], owner: str) -> None:
    """Refuse a state whose fields have the wrong type or an impossible value, naming each.

    A field absent from ``state`` is not checked here (`check_state_keys` names the required
    ones; optional ones have defaults).
    """
    problems = []
    for key, (kind, minimum) in rules.items():
        if key in state:
            expected = _field_problem(state[key], kind, minimum)
            if expected is not None:
                problems.append(f"{key} is {state[key]!r:.60}, expected {expected}")
    if problems:
        raise ValueError(f"{owner}.load_state_dict got a damaged sampler state ("
                         + "; ".join(problems) + "): it was not written by "
                         f"{owner}.state_dict() or was changed since; load the state as saved, "
                         "or start without loading it")


def saved_dp_size(state: Any) -> int | None:
    """The data-parallel size a sampler state was saved at (None where it does not say)."""
    fingerprint = state.get("fingerprint") if isinstance(state, dict) else None
    value = fingerprint.get("dp_size") if isinstance(fingerprint, dict) else None
    return value if _is_int(value) else None
