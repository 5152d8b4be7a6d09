"""The options of ``megatron-packing simulate``, ``tune`` and ``calibrate``, declared on the
command's one tree.

`megatron_packing.cli.build_parser` makes the subparsers; `add_simulate_arguments` and
`add_tune_arguments` declare their options, typed by one set of argument types (`integer`,
`fraction`) whose errors name the option. ``simulate`` has two forms on one subparser: on the
shipped length pools (the pool options) or, with ``--config``, on a training YAML's own data
(the report options); `resolve_simulate_form` refuses a mix of the two and fills in the pool
form's defaults. A refusal is a `UsageError`, which the command line reports through the
subcommand's parser (usage line, one message, exit status 2).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from megatron_packing.common.validation import allowed_batch_variation, require_int, require_number
from megatron_packing.packing.algorithms import PackingAlgorithm
from megatron_packing.packing.packer_config import PACKING_ALGORITHMS

from .pools import MIXED
from .tuning import DEFAULT_VARIATIONS, TUNE_MAX_STEPS

MIN_CAPACITY = 16  # tokens per bin below which a simulation is not meaningful


class UsageError(ValueError):
    """Arguments that parse one by one but do not make sense together (exit status 2)."""


def integer(name: str, minimum: int = 1) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum``, the error naming the option."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        return require_int(name, value, minimum=minimum, error=argparse.ArgumentTypeError)
    return parse


def fraction(name: str) -> Callable[[str], float]:
    """An argparse type: a number strictly between 0 and 1, the error naming the option."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name} must be a number in (0, 1), got {text!r}") from None
        return require_number(name, value, minimum=0, maximum=1, exclusive=True,
                              error=argparse.ArgumentTypeError)
    return parse


def non_negative(name: str) -> Callable[[str], float]:
    """An argparse type: a finite number >= 0, the error naming the option."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number >= 0, got {text!r}") from None
        return require_number(name, value, minimum=0, error=argparse.ArgumentTypeError)
    return parse


# The pool form's own options: (flag, default). Declared with default None (flags: False) so that
# a flag given with --config is seen and refused; the defaults are filled in afterwards.
POOL_OPTIONS: tuple[tuple[str, object], ...] = (
    ("--pool", MIXED), ("--pool-dir", None), ("--batch-size", 128), ("--capacity", 4096),
    ("--variation", 0.05), ("--algorithm", PackingAlgorithm.MFFD.value), ("--max-deferred", 0),
    ("--seed", 0), ("--no-exhaustive", False), ("--no-ceiling", False),
    ("--microbatch-cost-tokens", 0.0))
# Options both forms take, with the pool form's defaults (with --config: the YAML's train section).
SHARED_POOL_DEFAULTS: tuple[tuple[str, int], ...] = (("--dp-size", 8), ("--steps", 200))
CONFIG_OPTIONS = ("--output-dir", "--no-plot", "--quiet")  # the --config form's report options


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _given(args: argparse.Namespace, flags: tuple[str, ...]) -> list[str]:
    """The flags set on the command line (their declared default is None, or False for a switch)."""
    values = ((flag, getattr(args, _dest(flag))) for flag in flags)
    return [flag for flag, value in values if value is not None and value is not False]


def _report_arguments(parser: argparse._ActionsContainer, *, required: bool) -> None:
    """The options of the commands that report on a training YAML's data."""
    parser.add_argument("--config", metavar="YAML", required=required,
                        help="training YAML (packing: and data: sections)")
    parser.add_argument("--output-dir", metavar="DIR",
                        help="where the JSON and PNG go (default: reports/<config name>)")
    parser.add_argument("--no-plot", action="store_true", help="write no PNG")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    """Both forms of ``simulate``: on the length pools, or ``--config`` on a YAML's data."""
    both = parser.add_argument_group("both forms")
    both.add_argument("--dp-size", metavar="N", type=integer("--dp-size"),
                      help="data-parallel size (default: 8; with --config the YAML's "
                           "train.dp_size)")
    both.add_argument("--steps", metavar="K", type=integer("--steps"),
                      help="steps to plan (default: 200; with --config the YAML's train.steps, "
                           "else one epoch)")
    both.add_argument("--json", action="store_true", help="print JSON instead of a table")

    config = parser.add_argument_group(
        "on a training YAML's own data",
        "fixed B against DP-aligned packing with the YAML's packing: section over its data: "
        "section (through the cached length index); writes simulate.json and simulate.png")
    _report_arguments(config, required=False)

    pools = parser.add_argument_group(
        "on the shipped length pools (without --config)",
        "fixed B, the exhaustive reference, the planner (and with bounded deferral), "
        "Megatron-LM's own dp_balanced packing and the offline best contiguous path on one "
        "example stream")
    pools.add_argument("--pool", metavar="NAME",
                       help=f"pool name (file stem) or {MIXED!r} (sources drawn uniformly; "
                            f"default: {MIXED})")
    pools.add_argument("--pool-dir", metavar="DIR",
                       help="folder of *.txt length pools (default: benchmarks/data/lengths)")
    pools.add_argument("--batch-size", metavar="B", type=integer("--batch-size"),
                       help="global batch size (default: 128)")
    pools.add_argument("--capacity", metavar="C", type=integer("--capacity", MIN_CAPACITY),
                       help=f"tokens per bin (>= {MIN_CAPACITY}; default: 4096); lengths are "
                            "clipped to it")
    pools.add_argument("--variation", metavar="FRACTION", type=fraction("--variation"),
                       help="batch-size window as a fraction of B, in (0, 1) (default: 0.05)")
    pools.add_argument("--algorithm", choices=PACKING_ALGORITHMS,
                       help=f"packing algorithm (default: {PackingAlgorithm.MFFD.value})")
    pools.add_argument("--max-deferred", metavar="N", type=integer("--max-deferred", 0),
                       help="also run with bounded deferral of up to this many examples per step "
                            "(default: 0, no such run)")
    pools.add_argument("--seed", metavar="SEED", type=int,
                       help="seed of the example stream (default: 0)")
    pools.add_argument("--no-exhaustive", action="store_true",
                       help="skip the exhaustive reference planner (it packs every size every step)")
    pools.add_argument("--no-ceiling", action="store_true",
                       help="skip the offline best contiguous paths, most aligned steps and fewest "
                       "bins (about (2v+1)^2 packs per step)")
    pools.add_argument("--microbatch-cost-tokens", metavar="TOKENS",
                       type=non_negative("--microbatch-cost-tokens"),
                       help="what one micro-batch costs of its own, in tokens (the YAML key of "
                            "that name; default: 0), for planning and for the modeled times")


def resolve_simulate_form(args: argparse.Namespace) -> None:
    """Refuse a mix of the two forms; for the pool form, fill in its defaults and check that
    the batch-size window holds at least one example."""
    if args.config is not None:
        given = _given(args, tuple(flag for flag, _ in POOL_OPTIONS))
        if given:
            raise UsageError(
                f"{', '.join(given)} {'is an option' if len(given) == 1 else 'are options'} of "
                "the length-pool simulation, not of --config: the YAML's packing: and data: "
                "sections set the batch, capacity, algorithm and data there")
        return
    given = _given(args, CONFIG_OPTIONS)
    if given:
        raise UsageError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only "
                         "with --config train.yaml (the length-pool simulation prints its "
                         "table and writes no files)")
    for flag, default in (*POOL_OPTIONS, *SHARED_POOL_DEFAULTS):
        if getattr(args, _dest(flag)) is None:
            setattr(args, _dest(flag), default)
    if allowed_batch_variation(args.batch_size, args.variation) < 1:
        raise UsageError(f"--variation {args.variation} gives a window of floor({args.batch_size} "
                         f"x {args.variation}) = 0 examples; use at least {1 / args.batch_size:.4g}")


def add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    """``tune``: the capacity x variation grid on a training YAML's data."""
    _report_arguments(parser, required=True)
    parser.add_argument("--dp-size", metavar="N", type=integer("--dp-size"),
                        help="data-parallel size (default: the YAML's train.dp_size)")
    parser.add_argument("--steps", metavar="K", type=integer("--steps"),
                        help=f"steps per grid point (default: the YAML's train.steps or one "
                             f"epoch, at most {TUNE_MAX_STEPS})")
    parser.add_argument("--capacities", metavar="C", type=integer("--capacities"), nargs="+",
                        help="bin capacities to try (default: half, the current one and double)")
    parser.add_argument("--variations", metavar="FRACTION", type=fraction("--variations"),
                        nargs="+", help="variations to try (default: "
                                        f"{' '.join(map(str, DEFAULT_VARIATIONS))})")


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    """``calibrate``: time one layer on a GPU (or fit saved timings) for the two cost keys."""
    parser.add_argument("--config", metavar="YAML",
                        help="training YAML: the layer's shape from its model: section, the "
                             "capacity from packing.bin_capacity; --write sets the keys in it")
    shape = parser.add_argument_group("the layer (each overrides the YAML's model: key)")
    shape.add_argument("--hidden-size", metavar="H", type=integer("--hidden-size"))
    shape.add_argument("--num-attention-heads", metavar="N", type=integer("--num-attention-heads"))
    shape.add_argument("--ffn-hidden-size", metavar="F", type=integer("--ffn-hidden-size"),
                       help="MLP hidden size (default: the YAML's, else 4 x hidden)")
    shape.add_argument("--dtype", choices=("bf16", "fp16", "fp32"),
                       help="dtype of the timed layer (default: the YAML's model.dtype, else bf16)")
    shape.add_argument("--capacity", metavar="C", type=integer("--capacity", 64),
                       help="bin capacity in tokens (default: the YAML's packing.bin_capacity)")
    timing = parser.add_argument_group("timing")
    timing.add_argument("--repeats", metavar="N", type=integer("--repeats"), default=5,
                        help="timed runs per composition, after 2 untimed (median; default 5)")
    timing.add_argument("--time-limit-s", metavar="S", type=non_negative("--time-limit-s"),
                        help="stop timing after S seconds and fit what was timed, if enough")
    timing.add_argument("--device", choices=("cuda", "cpu"),
                        help="cuda (default). cpu only tests the harness: CPU timings do not "
                             "predict a GPU")
    out = parser.add_argument_group("output")
    out.add_argument("--from-timings", metavar="FILE",
                     help="fit a saved timings file (JSON lines {\"lengths\": [...], \"ms\": "
                          "...}) instead of timing: no GPU needed")
    out.add_argument("--output-dir", metavar="DIR",
                     help="write timings.jsonl and the printed report (calibration.md) here")
    out.add_argument("--write", action="store_true",
                     help="set attention_cost_constant and microbatch_cost_tokens in the "
                          "--config file's packing: section (the rest of the file is kept)")
