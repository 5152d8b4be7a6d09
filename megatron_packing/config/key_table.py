"""The README's table of ``packing:`` keys, generated from the config tree.

Defaults come from `PackingConfig` itself and the key order from `YAML_KEYS`; only the one-line
meanings are written here. ``python -m megatron_packing.config.key_table --write-docs`` rewrites
the table in README.md between its markers; a test fails when the README differs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from megatron_packing.config.components import YAML_KEYS
from megatron_packing.config.packing_config import PackingConfig

MEANINGS: dict[str, str] = {
    "global_batch_size": "B: examples per step on average",
    "bin_capacity": "tokens per packed row, alignment padding included",
    "use_sequence_packing": "pack THD rows; false: padded `[b, max_len]` micro-batches",
    "align_packing_bins_to_dp": "vary the batch size so the bin count divides by dp",
    "packing_batch_size_allowed_variation": "the window as a fraction of B, in (0, 1): "
                                            "v = floor(B x fraction) examples, v >= 1",
    "packing_algorithm": "`mffd`, `ffd` or `bfd`",
    "oversize_policy": "an example longer than the capacity: `error`, `truncate` or `own_bin`",
    "max_tokens_per_microbatch": "padded mode: fill each micro-batch up to this many padded "
                                 "tokens",
    "micro_batch_size": "padded mode without a token budget",
    "tp_size": "tensor-parallel size: a row's length divides by tp "
               "([docs/packing.md](docs/packing.md))",
    "cp_size": "context-parallel size: with cp > 1 each sequence rounds up to 2 x tp x cp",
    "fp8_enabled": "FP8 alignment: a row's length divides by the recipe's multiple",
    "fp8_recipe": "`delayed`, `tensorwise`, `mxfp8` or `blockwise` (needs `fp8_enabled`)",
    "base_order": "`random` (seeded shuffle per epoch) or `sequential`",
    "seed": "seeds the example order (and nothing else)",
    "rank_assignment": "work to ranks, by the cost `s + s^2/k`: whole bins balanced, then "
                       "examples moved from the ranks above the mean to the lightest "
                       "(`rebalanced`); whole bins only (`karmarkar_karp`, the earlier default: "
                       "runs checkpointed under it resume with it); or `round_robin`",
    "attention_cost_constant": "k in the cost, about 6 x hidden size",
    "microbatch_cost_tokens": "what one micro-batch costs of its own, in tokens: a bin costs "
                              "this plus `s + s^2/k` of its sequences; 0 charges nothing per "
                              "bin (`megatron-packing calibrate` measures both constants; "
                              "[docs/calibrate.md](docs/calibrate.md))",
    "pad_bins_to_capacity": "pad every row to exactly C (static shapes, pipeline parallel)",
    "lookahead_steps": "steps planned together when choosing a boundary (1 = greedy)",
    "max_deferred_examples": "bounded deferral: a step may leave up to d examples of its window "
                             "to lead the next step (at most one step late); needs "
                             "`align_packing_bins_to_dp`",
    "pad_token_id": "token id used for padding",
}
"""One line per YAML key, in the README's words."""

START, END = "<!-- config-keys:start -->", "<!-- config-keys:end -->"
README = Path(__file__).resolve().parents[2] / "README.md"


def _show(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def render() -> str:
    """The table, one row per YAML key, defaults read from a default `PackingConfig`."""
    defaults = PackingConfig().to_dict()
    missing = sorted(set(YAML_KEYS) - set(MEANINGS))
    stray = sorted(set(MEANINGS) - set(YAML_KEYS))
    if missing or stray:
        raise KeyError(f"key meanings out of date: missing {missing}, not keys {stray}")
    rows = ["| key | default | meaning |", "|---|---|---|"]
    rows += [f"| `{key}` | {_show(defaults[key])} | {MEANINGS[key]} |" for key in YAML_KEYS]
    return "\n".join(rows)


def replace_table(text: str, table: str) -> str:
    """``text`` with the part between the markers replaced by ``table``."""
    head, sep, rest = text.partition(START)
    _, sep_end, tail = rest.partition(END)
    if not sep or not sep_end:
        raise ValueError(f"README.md lacks the markers {START} ... {END}")
    return f"{head}{START}\n{table}\n{END}{tail}"


def main(argv: list[str]) -> int:
    if argv != ["--write-docs"]:
        print("usage: python -m megatron_packing.config.key_table --write-docs", file=sys.stderr)
        return 2
    README.write_text(replace_table(README.read_text(), render()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
