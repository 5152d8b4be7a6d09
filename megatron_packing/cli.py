"""The ``megatron-packing`` command: ``train``, ``prepare``, ``simulate``, ``tune``, ``inspect``,
``budget`` and ``calibrate``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _train(args: argparse.Namespace) -> int:
    """Check everything that can be checked, then train (spawning ranks, or under torchrun)."""
    from megatron_packing.common.validation import require_positive_int
    from megatron_packing.config import ConfigError
    from megatron_packing.config.training import load_training_config
    from megatron_packing.data import BadRecordError, CorruptStoreError
    from megatron_packing.demo.checkpoint import CheckpointError
    from megatron_packing.demo.launch import RankFailed, RunInterrupted, is_main_process
    from megatron_packing.demo.run_dir import OutputDirHoldsRun
    from megatron_packing.demo.run_lock import OutputDirInUse
    from megatron_packing.demo.trainer import (
        PeerFailed,
        TrainingError,
        format_summary,
        train,
    )
    from megatron_packing.demo.write_faults import WriteFault

    try:
        cfg = load_training_config(args.config)
        if args.steps is not None:
            cfg.train.steps = require_positive_int("--steps", args.steps)
        out = args.output_dir or cfg.train.output_dir
        summary = train(cfg, output_dir=out, resume=args.resume, use_wandb=not args.no_wandb,
                        overwrite=args.overwrite)
    except RunInterrupted as exc:
        print(f"megatron-packing train: {exc}; the latest checkpoint is under {out}/checkpoints "
              "and --resume continues from it", file=sys.stderr, flush=True)
        return 128 + exc.signum
    except RankFailed as exc:
        if exc.refusal:
            print(f"megatron-packing train: error: {exc}", file=sys.stderr, flush=True)
            return 2
        if exc.detail:
            print(f"megatron-packing train: internal error on rank {exc.rank}, a bug in "
                  f"megatron_packing (please report it with this traceback):\n{exc.detail}",
                  file=sys.stderr, end="", flush=True)
        else:
            print(f"megatron-packing train: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except PeerFailed:
        return 2  # rank 0 of the torchrun launch prints the refusal
    except WriteFault as exc:  # the OS refused a write: a fault, not a refusal of the input
        print(f"megatron-packing train: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except (ConfigError, CheckpointError, TrainingError, OutputDirInUse, OutputDirHoldsRun,
            BadRecordError, CorruptStoreError) as exc:
        print(f"megatron-packing train: error: {exc}", file=sys.stderr, flush=True)
        return 2
    if is_main_process():
        print("\n== summary ==")
        print(format_summary(summary))
        print(f"outputs          {out}/ (metrics.jsonl, metrics.png, summary.json, checkpoints/)")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from megatron_packing.config import ConfigError
    from megatron_packing.data import BadRecordError, CorruptStoreError

    try:
        return _inspect_config(args)
    except (ConfigError, BadRecordError, CorruptStoreError, FileNotFoundError) as exc:
        print(f"megatron-packing inspect: error: {exc}", file=sys.stderr, flush=True)
        return 2


def _inspect_config(args: argparse.Namespace) -> int:
    from megatron_packing.config import PackingConfig, read_yaml_mapping
    from megatron_packing.config.sections import SECTIONS, read_sections

    document = read_yaml_mapping(args.config)
    if isinstance(document, dict) and any(name in document for name in SECTIONS):
        # A training YAML: read as every command reads it (a trainer's file as `train` does).
        sections = read_sections(args.config, command="megatron-packing inspect")
        section = sections.packing_values
    else:  # a file of packing keys alone
        section = document if isinstance(document, dict) else {}
    dp = args.dp_size
    if dp is None and isinstance(document, dict):
        dp = (document.get("train") or {}).get("dp_size")
    packing = PackingConfig.from_dict(section, source=args.config).validate(dp)
    print(f"packing ({args.config}, dp={dp}):")
    for key, value in packing.to_dict().items():
        note = "   (the example order's seed: the one `train` uses)" if key == "seed" else ""
        print(f"  {key}: {value}{note}")
    print(f"  v (allowed batch variation): {packing.v} examples "
          f"-> batch size in [{packing.global_batch_size - packing.v}, "
          f"{packing.global_batch_size + packing.v}]")
    if args.data or args.with_data:
        from megatron_packing.reports.commands import inspect_data

        return inspect_data(document if isinstance(document, dict) else {}, args.config,
                            paths=args.data, tokenizer=args.tokenizer,
                            capacity=packing.bin_capacity, output_dir=args.output_dir,
                            quiet=args.quiet, plot=not args.no_plot)
    return 0


def _prepare(args: argparse.Namespace) -> int:
    """Build (or verify) the config's length-index cache, so the job never waits to tokenize."""
    from megatron_packing.config import ConfigError
    from megatron_packing.data import BadRecordError, CorruptStoreError
    from megatron_packing.reports.prepare import PrepareError, prepare_command

    try:
        return prepare_command(args.config, args.workers)
    except (ConfigError, PrepareError, BadRecordError, CorruptStoreError) as exc:
        print(f"megatron-packing prepare: error: {exc}", file=sys.stderr, flush=True)
        return 2


def _budget(args: argparse.Namespace) -> int:
    """Write a token-budget change for a running padded-mode job (its control file)."""
    from pathlib import Path

    from megatron_packing.padded.control_file import BUDGET_FILE, write_budget_file

    run_dir = Path(args.run_dir)
    problem = None
    if not run_dir.is_dir():
        problem = (f"--run-dir {run_dir} is not a directory; give the job's --save directory "
                   "(or write the file named by its --packing-budget-file with --file)")
    elif args.max_tokens <= 0:
        problem = f"max_tokens_per_microbatch {args.max_tokens}: give a token count >= 1"
    elif args.from_step is not None and args.from_step < 0:
        problem = f"--from-step {args.from_step}: give a step >= 0 (or leave it out: the next step)"
    if problem is not None:
        print(f"megatron-packing budget: error: {problem}", file=sys.stderr, flush=True)
        return 2
    path = write_budget_file(run_dir / (args.file or BUDGET_FILE), args.max_tokens, args.from_step)
    when = f"from step {args.from_step}" if args.from_step is not None else \
        "from the first step no rank has planned yet"
    print(f"wrote {path}: max_tokens_per_microbatch {args.max_tokens} {when}; the job takes it "
          "at its next budget check and logs the step (a step already planned is refused in "
          "its log)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: one parser, a subparser per command with all its options."""
    from megatron_packing.reports.arguments import (
        add_calibrate_arguments,
        add_simulate_arguments,
        add_tune_arguments,
        integer,
    )

    parser = argparse.ArgumentParser(prog="megatron-packing",
                                     description="DP-aligned sequence packing for Megatron SFT")
    sub = parser.add_subparsers(dest="command", required=True)

    tr = sub.add_parser("train", help="train the CPU demo model (2 DP ranks on gloo)")
    tr.add_argument("--config", required=True, help="training YAML (packing, data, model, train, logging)")
    tr.add_argument("--output-dir", help="where metrics, plot and checkpoints go")
    tr.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    tr.add_argument("--overwrite", action="store_true",
                    help="replace a run already in the output directory (its metrics, summary "
                         "and checkpoints); without it, or --resume, such a directory is refused")
    tr.add_argument("--no-wandb", action="store_true", help="do not log to W&B")
    tr.add_argument("--steps", type=int, help="override train.steps")
    tr.add_argument("--verbose", action="store_true",
                    help="show every third-party start-up warning (by default the known "
                         "harmless ones collapse into one line; a set PYTHONWARNINGS also "
                         "shows them)")

    prep = sub.add_parser(
        "prepare", help="tokenize a YAML's data ahead of the job: build (or verify) the length "
                        "index and token store in data.cache_dir",
        description="Build the length-index cache of data.paths and data.valid_paths (or load "
                    "and verify it when present) with the loader call `train` and the "
                    "Megatron-LM entry point make, so the job finds it and does not tokenize. "
                    "Prints, per split, examples, tokens, loss tokens, skipped records, the "
                    "cache entries (built or already present) and the build time. A build of "
                    "the same entry by another process is named (its lock file) and waited for.")
    prep.add_argument("--config", required=True,
                      help="a training YAML, or the Megatron-LM --packing-config YAML; its "
                           "data: section must set cache_dir")
    prep.add_argument("--workers", type=integer("--workers", 1), default=1,
                      help="tokenizer processes (default 1); the cache is the same for any count")

    sim = sub.add_parser(
        "simulate", help="simulate packing and DP alignment on the shipped length pools, or "
                         "with --config on a training YAML's own data",
        description="Fixed B against DP-aligned packing, planned with the real sampler. With "
                    "--config: on the YAML's own data and packing section (table, JSON, PNG). "
                    "Without: on the shipped length pools, beside the exhaustive reference and "
                    "the offline best contiguous path (table or JSON).")
    add_simulate_arguments(sim)
    sim.set_defaults(command_parser=sim)  # a refusal after parsing is reported by its parser
    tune = sub.add_parser(
        "tune", help="sweep capacity x variation on a training YAML's data and recommend a "
                     "setting",
        description="Sweep bin capacity x batch-size variation on the config's own data (a short "
                    "aligned simulation per point) and recommend a setting, with the reasons.")
    add_tune_arguments(tune)
    tune.set_defaults(command_parser=tune)
    cal = sub.add_parser(
        "calibrate", help="measure attention_cost_constant and microbatch_cost_tokens on a GPU",
        description="Time one transformer layer of the model's shape (forward + backward) over "
                    "bin compositions at the capacity, fit ms = a + b x tokens + c x sum(s^2), "
                    "and print each composition measured against modeled and the two keys "
                    "(attention_cost_constant = b/c, microbatch_cost_tokens = a/b). Needs a GPU, "
                    "unless --from-timings fits a saved timings file.")
    add_calibrate_arguments(cal)

    ins = sub.add_parser("inspect", help="print a config's resolved packing keys and v")
    ins.add_argument("--config", required=True)
    ins.add_argument("--dp-size", type=int, help="validate against this dp size")
    ins.add_argument("--data", nargs="+", help="dataset path(s) for length statistics")
    ins.add_argument("--tokenizer", help="tokenizer directory for --data")
    ins.add_argument("--with-data", action="store_true",
                     help="also load the config's data section (its cache_dir, on_bad_record "
                          "and loss_on): length statistics and a histogram PNG")
    ins.add_argument("--output-dir", help="where lengths.png goes (default: reports/<config name>)")
    ins.add_argument("--no-plot", action="store_true", help="write no PNG")
    ins.add_argument("--quiet", action="store_true", help="no progress bars")

    bud = sub.add_parser("budget", help="change a running padded-mode job's token budget "
                         "(max_tokens_per_microbatch) at a step boundary")
    bud.add_argument("--run-dir", required=True,
                     help="the job's --save directory (where it reads token_budget.json)")
    bud.add_argument("max_tokens", type=int, help="the new max_tokens_per_microbatch")
    bud.add_argument("--from-step", type=int, default=None,
                     help="the first step (0-based, counted across epochs) to plan with it; "
                          "default: the next step no rank has planned")
    bud.add_argument("--file", default=None,
                     help="the control file's name in --run-dir (default: token_budget.json)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``megatron-packing``: one parse of the whole tree, then the subcommand."""
    args = build_parser().parse_args(argv)
    from megatron_packing.common.user_warnings import one_line_warnings

    one_line_warnings(f"megatron-packing {args.command}")
    if args.command in ("simulate", "tune"):
        from megatron_packing.reports.arguments import UsageError
        from megatron_packing.reports.commands import simulate_command, tune_command

        try:
            return simulate_command(args) if args.command == "simulate" else tune_command(args)
        except UsageError as exc:
            args.command_parser.error(str(exc))  # usage line, the message, exit status 2
    if args.command == "train":
        from megatron_packing.common import quiet_start

        quiet_start.begin(f"megatron-packing train: starting with {args.config}",
                          verbose=args.verbose, verbose_flag="--verbose")
        try:
            return _train(args)
        except Exception:  # not a refusal: show where, under one line that says what it is
            import traceback

            print("megatron-packing train: internal error, a bug in megatron_packing (please "
                  f"report it with this traceback):\n{traceback.format_exc()}", file=sys.stderr,
                  end="", flush=True)
            return 1
        finally:
            quiet_start.end()
    if args.command == "budget":
        return _budget(args)
    if args.command == "calibrate":
        from megatron_packing.reports.calibration import calibrate_command

        return calibrate_command(args)
    if args.command == "prepare":
        return _prepare(args)
    return _inspect(args)


if __name__ == "__main__":
    sys.exit(main())
