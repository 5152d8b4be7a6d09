"""``simulate`` and ``tune`` live in the command line's one argparse tree, parsed once.

`cli.build_parser` declares every option of both commands (both forms of ``simulate``); no
other module of the package builds a parser for them. A mix of the two ``simulate`` forms is
refused by the subcommand's parser: exit status 2, one message, no traceback.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import megatron_packing
from megatron_packing.cli import build_parser, main

PACKAGE = Path(megatron_packing.__file__).parent
POOL_OPTIONS = {"pool", "pool_dir", "batch_size", "capacity", "variation", "algorithm",
                "max_deferred", "seed", "no_exhaustive", "no_ceiling"}
CONFIG_OPTIONS = {"config", "output_dir", "no_plot", "quiet"}
SHARED = {"dp_size", "steps", "json"}
# Megatron-LM's own parser (its arguments, extended by the plugin's), not the package's command.
MEGATRON_PARSERS = {"megatron_lm/argument_policy.py", "megatron_lm/entry.py", "megatron/compat.py"}


def test_the_simulate_subparser_declares_both_forms_options():
    args = build_parser().parse_args(["simulate"])
    assert set(vars(args)) >= POOL_OPTIONS | CONFIG_OPTIONS | SHARED
    assert all(getattr(args, name) in (None, False) for name in POOL_OPTIONS | CONFIG_OPTIONS)
    pooled = build_parser().parse_args(["simulate", "--pool", "gsm8k", "--batch-size", "16",
                                        "--max-deferred", "2", "--no-ceiling"])
    assert (pooled.pool, pooled.batch_size, pooled.max_deferred, pooled.no_ceiling) == (
        "gsm8k", 16, 2, True)
    configured = build_parser().parse_args(["simulate", "--config", "t.yaml", "--dp-size", "4",
                                            "--quiet", "--output-dir", "o"])
    assert (configured.config, configured.dp_size, configured.quiet, configured.output_dir) == (
        "t.yaml", 4, True, "o")


def test_the_tune_subparser_declares_its_options():
    args = build_parser().parse_args(["tune", "--config", "t.yaml", "--capacities", "128", "256",
                                      "--variations", "0.1", "--steps", "5"])
    assert (args.capacities, args.variations, args.steps) == ([128, 256], [0.1], 5)
    assert {"dp_size", "output_dir", "no_plot", "quiet"} <= set(vars(args))


def _parser_calls(path: Path) -> list[str]:
    calls = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            if name in ("ArgumentParser", "parse_args", "parse_known_args", "add_subparsers"):
                calls.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {name}")
    return calls


def test_no_module_but_cli_builds_or_runs_a_parser_of_the_package_command():
    outside = [call for path in sorted(PACKAGE.rglob("*.py"))
               if path.name != "cli.py" or path.parent != PACKAGE
               if str(path.relative_to(PACKAGE)) not in MEGATRON_PARSERS
               for call in _parser_calls(path)]
    assert outside == []
    tree = _parser_calls(PACKAGE / "cli.py")
    assert sorted(c.split(": ")[1] for c in tree) == ["ArgumentParser", "add_subparsers",
                                                      "parse_args"]


@pytest.mark.parametrize("command, options", [
    ("simulate", ["--config", "--output-dir", "--no-plot", "--quiet", "--dp-size", "--steps",
                  "--json", "--pool", "--pool-dir", "--batch-size", "--capacity", "--variation",
                  "--algorithm", "--max-deferred", "--seed", "--no-exhaustive", "--no-ceiling"]),
    ("tune", ["--config", "--dp-size", "--output-dir", "--no-plot", "--quiet", "--steps",
              "--capacities", "--variations"]),
])
def test_help_lists_every_option(command, options, capsys):
    with pytest.raises(SystemExit) as raised:
        main([command, "--help"])
    assert raised.value.code == 0
    shown = capsys.readouterr().out
    assert shown.startswith(f"usage: megatron-packing {command} ")
    assert [o for o in options if f"{o} " not in shown and f"{o}\n" not in shown] == []


@pytest.mark.parametrize("argv, message", [
    (["--config", "t.yaml", "--batch-size", "16"],
     "--batch-size is an option of the length-pool simulation, not of --config"),
    (["--config", "t.yaml", "--seed", "0", "--no-exhaustive"],
     "--seed, --no-exhaustive are options of the length-pool simulation"),
    (["--output-dir", "o"], "--output-dir applies only with --config"),
    (["--no-plot", "--quiet"], "--no-plot, --quiet apply only with --config"),
    (["--pool", "nope", "--steps", "2"], "unknown pool 'nope'; choose 'mixed' or one of "),
    (["--pool-dir", "/nonexistent/pools"], "no length pools (*.txt, one length per line) found in: "
                                            "/nonexistent/pools"),
])
def test_a_mix_of_the_two_simulate_forms_is_refused_by_the_subcommand(argv, message, capsys):
    with pytest.raises(SystemExit) as raised:
        main(["simulate", *argv])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: megatron-packing simulate ")
    errors = [line for line in err.splitlines() if "error:" in line]
    assert errors == [f"megatron-packing simulate: error: {errors[0].split('error: ', 1)[1]}"]
    assert message in errors[0] and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--steps", "0"], "argument --steps: --steps must be an integer >= 1, got 0"),
    (["tune", "--config", "t.yaml", "--capacities", "0"],
     "argument --capacities: --capacities must be an integer >= 1, got 0"),
    (["tune", "--config", "t.yaml", "--variations", "2"],
     "argument --variations: --variations must be a number in (0, 1), got 2.0"),
    (["tune", "--config", "t.yaml", "--dp-size", "two"],
     "argument --dp-size: --dp-size must be an integer, got 'two'"),
])
def test_one_set_of_argument_types_names_the_option(argv, message, capsys):
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == 2
    assert message in capsys.readouterr().err
