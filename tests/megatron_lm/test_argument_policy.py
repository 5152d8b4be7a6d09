"""Every Megatron-LM argument that its training loop reads is honoured or refused, and the
docs' table says which.

The walk reads Megatron-LM's own ``training.py`` (the loop functions of ``pretrain()``) and its
argument parser; a new Megatron release that reads a new argument fails here until the argument
is placed in `POLICY`.
"""

from __future__ import annotations

import argparse
import ast
import inspect

import pytest
from megatron_lm_runs import PROJECT, requires_megatron_lm

from megatron_packing.megatron_lm.argument_policy import POLICY, Honoured, policy_table

pytestmark = requires_megatron_lm

LOOP_FUNCTIONS = {"pretrain", "train", "train_step", "training_log", "evaluate",
                  "evaluate_and_print_results", "checkpoint_and_decide_exit",
                  "save_checkpoint_and_time", "post_training_step_callbacks"}
from megatron_packing.megatron_lm.argument_policy import TABLE_END, TABLE_START  # noqa: E402


def arguments_read_by_the_loop() -> set[str]:
    """``args.X`` and ``getattr(args, "X")`` inside Megatron-LM's loop functions, restricted to
    the names its parser defines."""
    from megatron.training import training
    from megatron.training.arguments import add_megatron_arguments

    tree = ast.parse(inspect.getsource(training))
    read: set[str] = set()
    for node in tree.body:
        if not (isinstance(node, ast.FunctionDef) and node.name in LOOP_FUNCTIONS):
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and \
                    sub.value.id == "args":
                read.add(sub.attr)
            elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and \
                    sub.func.id == "getattr" and len(sub.args) >= 2 and \
                    isinstance(sub.args[0], ast.Name) and sub.args[0].id == "args" and \
                    isinstance(sub.args[1], ast.Constant):
                read.add(sub.args[1].value)
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    return read & {action.dest for action in parser._actions}


def test_every_argument_the_loop_reads_is_honoured_or_refused():
    read = arguments_read_by_the_loop()
    assert len(read) > 80, "the walk found too little of Megatron's loop to mean anything"
    missing = sorted(read - set(POLICY))
    assert not missing, f"Megatron-LM's loop reads arguments the policy does not place: {missing}"


def test_every_honoured_argument_names_a_test_that_exists():
    for dest, rule in POLICY.items():
        if not isinstance(rule, Honoured):
            continue
        path, name = rule.test.split("::")
        source = (PROJECT / path).read_text()
        assert f"def {name}(" in source, f"{dest}: {rule.test} does not exist"


def test_the_docs_table_is_the_policy():
    doc = (PROJECT / "docs" / "megatron_lm.md").read_text()
    assert TABLE_START in doc and TABLE_END in doc
    table = doc.split(TABLE_START)[1].split(TABLE_END)[0].strip() + "\n"
    assert table == policy_table(), (
        "docs/megatron_lm.md's argument table differs from POLICY; regenerate it with "
        "`python -m megatron_packing.megatron_lm.argument_policy --write-docs`")


@pytest.mark.parametrize("name", ["--exit-signal-handler", "--exit-interval",
                                  "--exit-duration-in-mins", "--non-persistent-save-interval"])
def test_graceful_stop_arguments_are_honoured(name):
    assert isinstance(POLICY[name.removeprefix("--").replace("-", "_")], Honoured)


def test_the_walk_sees_a_new_argument(monkeypatch):
    """The walk is what guards the policy: an argument it finds and the policy lacks fails."""
    read = arguments_read_by_the_loop()
    dest = sorted(read)[0]
    monkeypatch.delitem(POLICY, dest)
    with pytest.raises(AssertionError, match=dest):
        test_every_argument_the_loop_reads_is_honoured_or_refused()


