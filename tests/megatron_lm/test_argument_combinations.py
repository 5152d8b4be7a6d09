"""Argument combinations that Megatron asserts on later are refused at start-up instead.

Each `Combination` is run twice through this release's own code: through Megatron's parser and
the entry point's start-up check (refused, with one line naming the flags and what would work),
and through Megatron itself (``validate_args``, the LR scheduler as ``setup_model_and_optimizer``
builds it, the optimizer config), which must fail on it: the rule is then a real one, not a
guess. Arguments next to each rule that Megatron takes must pass both. The checks that need the
data (a schedule sized in examples) or a checkpoint (``--load``) run on their own functions.
"""

from __future__ import annotations

import contextlib
import copy
import io
import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from megatron_lm_runs import (
    ITERS,
    MODEL_ARGS,
    B,
    launch,
    reference_args,
    requires_megatron_lm,
)
from test_arguments import REQUIRED, megatron_args

from megatron_packing.megatron_lm.argument_policy import (
    COMBINATIONS,
    POLICY,
    Combination,
    combination_table,
)
from megatron_packing.megatron_lm.arguments import (
    MegatronArgumentError,
    check_megatron_arguments,
    check_saved_schedule,
    check_schedule_fits,
    scheduler_state,
)
from megatron_packing.megatron_lm.schedule import schedule_in_examples

pytestmark = requires_megatron_lm


def _argv(rule_sample: tuple[str, ...] = (), without: tuple[str, ...] = ()) -> list[str]:
    """A valid command line (the tests' model, 4 iterations of B 16, warm-up 2), less the flags
    in ``without`` (each with its value), plus ``rule_sample``."""
    argv = [*MODEL_ARGS, *REQUIRED]
    for flag in without:
        index = argv.index(flag)
        del argv[index:index + 2]
    return [*argv, *rule_sample]


def validated(argv: list[str]) -> Any:
    """Megatron's arguments for ``argv`` after its own ``validate_args`` (one process)."""
    from megatron.training.arguments import validate_args

    args = megatron_args(argv)
    args.world_size, args.rank = 1, 0
    with contextlib.redirect_stdout(io.StringIO()):
        validate_args(args)
    return args


def megatron_scheduler(args: Any, monkeypatch: pytest.MonkeyPatch, total: int | None = None):
    """Megatron's own LR scheduler for validated ``args``, built as ``setup_model_and_optimizer``
    builds it (in the entry point, inside `schedule_in_examples` for ``total`` examples), on an
    optimizer without parameters; ``args`` is left as it was."""
    from megatron.training import training

    args = copy.deepcopy(args)
    monkeypatch.setattr(training, "get_args", lambda: args)
    with schedule_in_examples(args, args.train_iters * args.global_batch_size
                              if total is None else total):
        return training.get_optimizer_param_scheduler(SimpleNamespace(param_groups=[]))


def megatron_failure(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> str | None:
    """Where this Megatron fails on ``argv`` once past its parser (None: it does not):
    ``validate_args``, the LR scheduler, or the optimizer config."""
    from megatron.training import training

    try:
        args = validated(argv)
        megatron_scheduler(args, monkeypatch)
        training.get_megatron_optimizer_config(args)
    except (AssertionError, TypeError, ValueError, RuntimeError) as failure:
        return f"{type(failure).__name__}: {failure}"
    return None


def test_the_base_command_line_passes_the_check_and_megatron(monkeypatch):
    check_megatron_arguments(megatron_args(_argv()))
    assert megatron_failure(_argv(), monkeypatch) is None


@pytest.mark.parametrize("rule", COMBINATIONS, ids=[rule.flags for rule in COMBINATIONS])
def test_each_combination_is_refused_at_start_up_where_megatron_would_fail_later(
        rule: Combination, monkeypatch):
    argv = _argv(rule.sample, rule.without)
    assert megatron_failure(argv, monkeypatch) is not None, \
        f"Megatron takes {rule.sample} (without {rule.without}): the rule refuses a valid setting"
    args = megatron_args(argv)
    line = rule.refuse(args)
    assert line is not None and "\n" not in line
    with pytest.raises(MegatronArgumentError) as refused:
        check_megatron_arguments(args)
    assert line in str(refused.value)
    for flag in [*rule.sample, *rule.without]:
        if flag.startswith("--"):
            assert flag.split("=")[0] in line, f"the line does not name {flag}: {line}"
    assert re.search(r"\b(give|add|drop|remove|use)\b", line), f"nothing says what works: {line}"


# Settings next to each rule that Megatron takes: none may be refused.
ACCEPTED = [
    ("--lr-warmup-iters", "3"),
    ("--lr-warmup-iters", "0", "--lr-warmup-fraction", "0.5"),
    ("--lr-decay-iters", "3"),
    ("--lr-decay-iters", "8", "--lr-warmup-iters", "6"),
    ("--min-lr", "3e-3"),
    ("--min-lr", "0"),
    ("--lr-warmup-init", "3e-3"),
    ("--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2"),
    ("--lr-decay-style", "constant"),
    ("--weight-decay-incr-style", "linear", "--start-weight-decay", "0.01",
     "--end-weight-decay", "0.1"),
    ("--weight-decay-incr-style", "cosine", "--start-weight-decay", "0",
     "--end-weight-decay", "0"),
    ("--weight-decay", "0"),
    ("--override-opt_param-scheduler",),
    ("--use-checkpoint-opt_param-scheduler",),
    ("--save", "ckpt", "--save-interval", "4", "--save-retain-interval", "8"),
    ("--log-memory-interval", "4", "--log-interval", "2"),
]


@pytest.mark.parametrize("extra", ACCEPTED, ids=[" ".join(extra) for extra in ACCEPTED])
def test_settings_megatron_takes_are_not_refused(extra, monkeypatch):
    assert megatron_failure(_argv(extra), monkeypatch) is None
    check_megatron_arguments(megatron_args(_argv(extra)))


@pytest.mark.parametrize("dest", ["lr_decay_samples", "lr_warmup_samples"])
def test_sample_based_schedule_arguments_megatron_refuses_with_iterations_are_refused(
        dest, monkeypatch):
    sample = POLICY[dest].sample  # type: ignore[union-attr]
    assert megatron_failure(_argv(sample), monkeypatch) is not None
    with pytest.raises(MegatronArgumentError, match=sample[0]):
        check_megatron_arguments(megatron_args(_argv(sample)))


def test_the_headline_case_names_both_flags_and_the_longest_warm_up_that_works():
    with pytest.raises(MegatronArgumentError,
                       match=r"--lr-warmup-iters 4 is not shorter than --train-iters 4: .*give "
                             r"--lr-warmup-iters 3 or less"):
        check_megatron_arguments(megatron_args(_argv(("--lr-warmup-iters", "4"))))
    with pytest.raises(MegatronArgumentError,
                       match=r"--lr-warmup-iters 2 is not shorter than --lr-decay-iters 2"):
        check_megatron_arguments(megatron_args(_argv(("--lr-decay-iters", "2"))))


def test_skip_train_builds_no_scheduler_so_its_rules_do_not_apply():
    check_megatron_arguments(megatron_args(_argv(("--lr-warmup-iters", "4", "--skip-train"))))
    with pytest.raises(MegatronArgumentError, match="--min-lr 1 is above --lr 0.003"):
        check_megatron_arguments(megatron_args(_argv(("--min-lr", "1", "--skip-train"))))


def test_the_docs_list_every_combination():
    from megatron_lm_runs import PROJECT

    from megatron_packing.megatron_lm.argument_policy import COMBINATIONS_END, COMBINATIONS_START

    doc = (PROJECT / "docs" / "megatron_lm.md").read_text()
    table = doc.split(COMBINATIONS_START)[1].split(COMBINATIONS_END)[0].strip() + "\n"
    assert table == combination_table(), (
        "docs/megatron_lm.md's combination table differs from COMBINATIONS; regenerate it with "
        "`python -m megatron_packing.megatron_lm.argument_policy --write-docs`")


# ---- a schedule sized in the examples of several epochs

def test_a_warm_up_that_outlasts_the_examples_of_several_epochs_is_refused(monkeypatch):
    """10 iterations of 16 over 50 examples (4 steps an epoch) train 2 x 50 + 2 x 16 = 132
    examples: a warm-up of 9 iterations (144 examples) passes the start-up check, but Megatron's
    scheduler, sized to the 132, would assert."""
    argv = _argv(("--train-iters", "10", "--lr-warmup-iters", "9"))
    check_megatron_arguments(megatron_args(argv))
    args = validated(argv)
    with pytest.raises(AssertionError):
        megatron_scheduler(args, monkeypatch, total=132)
    with pytest.raises(MegatronArgumentError,
                       match=r"--lr-warmup-iters 9: this run trains 132 examples over --train-iters "
                             r"10 .* \(9 x 16 = 144 examples\) .* give --lr-warmup-iters 8 or less"):
        check_schedule_fits(args, 132)
    check_schedule_fits(args, 160)  # inside one epoch: Megatron's own sizing, checked at start-up
    shorter = validated(_argv(("--train-iters", "10", "--lr-warmup-iters", "8")))
    check_schedule_fits(shorter, 132)
    megatron_scheduler(shorter, monkeypatch, total=132)


@pytest.mark.parametrize(("extra", "total"), [
    ((), 64), ((), 40), (("--lr-warmup-iters", "0", "--lr-warmup-fraction", "0.25"), 40),
    (("--lr-decay-iters", "3"), 40),
    (("--weight-decay-incr-style", "linear", "--start-weight-decay", "0.01",
      "--end-weight-decay", "0.1", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "1"), 64),
])
def test_the_schedule_the_resume_check_expects_is_megatrons(extra, total, monkeypatch):
    args = validated(_argv(extra))
    built = megatron_scheduler(args, monkeypatch, total=total).state_dict()
    built.pop("num_steps")
    assert scheduler_state(args, total) == built


# ---- --load: what Megatron's load_checkpoint would assert on after building the model

def _torch_format_checkpoint(directory: Path, args: Any, monkeypatch) -> Path:
    """A checkpoint of the torch format at iteration 4, as Megatron's save_checkpoint lays it
    out, holding ``args`` and the scheduler Megatron builds for them (no weights)."""
    import torch
    from megatron.training.checkpointing import get_checkpoint_tracker_filename

    path = Path(_rank_0_file(directory))
    path.parent.mkdir(parents=True)
    torch.save({"args": args, "iteration": 4, "checkpoint_version": 3.0,
                "opt_param_scheduler": megatron_scheduler(args, monkeypatch).state_dict()}, path)
    Path(get_checkpoint_tracker_filename(str(directory))).write_text("4")
    return directory


def _rank_0_file(directory: Path) -> str:
    from megatron.training.checkpointing import get_checkpoint_name

    return get_checkpoint_name(str(directory), 4, pipeline_parallel=False, tensor_rank=0,
                               pipeline_rank=0, expert_parallel=False, expert_rank=0)


@pytest.fixture
def saved(tmp_path, monkeypatch) -> Path:
    return _torch_format_checkpoint(tmp_path / "ckpt", validated(_argv()), monkeypatch)


def _resuming(saved: Path, *extra: str) -> Any:
    return validated(_argv(("--load", str(saved), *extra)))


def test_a_resume_with_the_saved_arguments_passes(saved):
    args = _resuming(saved)
    check_saved_schedule(args, args.train_iters * args.global_batch_size)


@pytest.mark.parametrize(("extra", "named"), [
    (("--train-iters", "8"), r"lr_decay_steps 64 saved, 128 now \(--train-iters 8 x "
                             r"--global-batch-size 16\); wd_incr_steps 64 saved, 128 now"),
    (("--lr", "1e-3"), r"max_lr 0.003 saved, 0.001 now \(--lr 0.001\)"),
    (("--min-lr", "1e-4"), r"min_lr 0.0003 saved, 0.0001 now \(--min-lr 0.0001\)"),
    (("--lr-warmup-iters", "1"), r"lr_warmup_steps 32 saved, 16 now \(--lr-warmup-iters 1 x "),
    (("--lr-decay-style", "linear"), r"lr_decay_style cosine saved, linear now"),
    (("--weight-decay", "0.1"), r"start_wd 0.01 saved, 0.1 now \(--weight-decay 0.1\)"),
])
def test_another_schedule_on_load_is_refused_before_megatron_asserts(saved, extra, named,
                                                                    monkeypatch):
    import torch

    args = _resuming(saved, *extra)
    total = args.train_iters * args.global_batch_size
    saved_state = torch.load(_rank_0_file(saved), weights_only=False)
    with pytest.raises(AssertionError):  # what Megatron's load_checkpoint does with it
        megatron_scheduler(args, monkeypatch).load_state_dict(saved_state["opt_param_scheduler"])
    with pytest.raises(MegatronArgumentError, match=rf"--load {saved}: the checkpoint at "
                                                    rf"iteration 4 was trained with another LR "
                                                    rf"schedule: .*{named}.*"
                                                    r"--override-opt_param-scheduler"):
        check_saved_schedule(args, total)


@pytest.mark.parametrize("way_out", ["--override-opt_param-scheduler",
                                     "--use-checkpoint-opt_param-scheduler", "--no-load-optim",
                                     "--finetune"])
def test_the_ways_megatron_takes_another_schedule_on_load_pass(saved, way_out):
    args = _resuming(saved, "--train-iters", "8", way_out)
    check_saved_schedule(args, args.train_iters * args.global_batch_size)


@pytest.mark.parametrize(("extra", "named"), [
    (("--num-layers", "4"), "--num-layers 2 (this run: 4)"),
    (("--hidden-size", "64"), "--hidden-size 32 (this run: 64)"),
    (("--num-attention-heads", "8"), "--num-attention-heads 4 (this run: 8)"),
])
def test_another_model_shape_on_load_is_refused(saved, extra, named, monkeypatch):
    from megatron.training import checkpointing

    args = _resuming(saved, *extra)
    monkeypatch.setattr(checkpointing, "_CHECKPOINT_VERSION", 3.0)
    monkeypatch.setattr(checkpointing, "get_args", lambda: args)
    with pytest.raises(AssertionError):  # Megatron's own comparison, in load_checkpoint
        checkpointing.check_checkpoint_args(validated(_argv()))
    with pytest.raises(MegatronArgumentError, match=re.escape(named)):
        check_saved_schedule(args, args.train_iters * args.global_batch_size)
    finetune = _resuming(saved, *extra, "--finetune")
    check_saved_schedule(finetune, finetune.train_iters * finetune.global_batch_size)


@pytest.mark.slow
@pytest.mark.one_stack(
    "the check reads the saved arguments, the same namespace in both releases; the "
    "rules are tested on both stacks in-process")
def test_a_longer_run_on_a_real_checkpoint_is_refused_before_the_model_is_built(reference,
                                                                                tmp_path):
    """The reference run's torch_dist checkpoints, loaded with twice its --train-iters."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference.tmp / "ckpt", ckpt)
    run = launch(2, reference_args(reference.tmp / "sft.yaml", tmp_path / "unused", "--load",
                                   str(ckpt), "--train-iters", str(2 * ITERS)), tmp_path / "log",
                 timeout=180)
    assert run.returncode != 0
    assert (f"--load {ckpt}: the checkpoint at iteration {ITERS} was trained with another LR "
            f"schedule: lr_decay_steps {ITERS * B} saved, {2 * ITERS * B} now (--train-iters "
            f"{2 * ITERS} x --global-batch-size {B})") in run.output
    assert "building GPT model" not in run.output
    assert run.output.count("megatron_packing.megatron_lm: error:") == 1
    assert "[rank0]: Traceback" not in run.output and "[rank1]: Traceback" not in run.output
