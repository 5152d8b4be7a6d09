"""Start-up refusals of the Megatron-LM entry point, and the packing config Megatron's arguments
complete. One launch checks that a refusal happens before any model is built."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
from megatron_lm_runs import (
    MODEL_ARGS,
    SKIP_REASON,
    launch,
    requires_megatron_lm,
    write_sft_yaml,
)

from megatron_packing.config import ConfigError, PackingConfig
from megatron_packing.megatron_lm.argument_policy import POLICY, Refused
from megatron_packing.megatron_lm.arguments import (
    MegatronArgumentError,
    check_megatron_arguments,
    check_padded_lengths,
    resolve_packing_config,
    validation_steps,
)


def _args(**overrides):
    values = dict(global_batch_size=64, tensor_model_parallel_size=1, context_parallel_size=1,
                  pipeline_model_parallel_size=1,
                  fp8=None, fp8_recipe="delayed", seq_length=1024, max_position_embeddings=1024)
    values.update(overrides)
    return SimpleNamespace(**values)


REQUIRED = ["--packing-config", "sft.yaml", "--global-batch-size", "16", "--train-iters", "4"]


def megatron_args(argv: list[str]):
    """What Megatron-LM's own parser makes of ``argv`` (before its validation), as the entry
    point's start-up check receives it."""
    from megatron.training.arguments import parse_args

    from megatron_packing.megatron_lm.arguments import add_packing_arguments

    saved = sys.argv
    sys.argv = ["entry", *argv]
    try:
        return parse_args(extra_args_provider=add_packing_arguments)
    finally:
        sys.argv = saved


@requires_megatron_lm
def test_the_test_model_arguments_pass():
    check_megatron_arguments(megatron_args([*MODEL_ARGS, *REQUIRED]))


def _this_releases_arguments() -> set[str] | None:
    """The installed Megatron-LM's argument names (None when it cannot be imported): the
    policy covers 0.16.1's and 0.19's arguments, and each release is tested on its own."""
    if SKIP_REASON is not None:
        return None
    from megatron_packing.megatron_lm.argument_policy import megatron_defaults

    return set(megatron_defaults())


_PRESENT = _this_releases_arguments()
REFUSED = sorted((dest, rule) for dest, rule in POLICY.items()
                 if isinstance(rule, Refused) and rule.sample
                 and (_PRESENT is None or dest in _PRESENT))


@requires_megatron_lm
@pytest.mark.parametrize(("dest", "rule"), REFUSED, ids=[dest for dest, _ in REFUSED])
def test_every_refused_argument_is_refused_through_the_real_parser(dest, rule):
    args = megatron_args([*MODEL_ARGS, *REQUIRED, *rule.sample])
    with pytest.raises(MegatronArgumentError) as refused:
        check_megatron_arguments(args)
    assert rule.message in str(refused.value)


@requires_megatron_lm
@pytest.mark.parametrize(("dropped", "message"), [
    ("--calculate-per-token-loss", "--calculate-per-token-loss is required"),
    ("--train-iters", "use --train-iters"),
])
def test_required_arguments_are_refused_by_name_when_missing(dropped, message):
    argv = [*MODEL_ARGS, *REQUIRED]
    index = argv.index(dropped)
    del argv[index:index + (2 if dropped == "--train-iters" else 1)]
    with pytest.raises(MegatronArgumentError, match=message):
        check_megatron_arguments(megatron_args(argv))


@requires_megatron_lm
def test_distributed_optimizer_checkpoints_are_refused_without_fused_adam():
    from megatron_packing.megatron_lm.arguments import optimizer_has_fused_adam

    saving = megatron_args([*MODEL_ARGS, *REQUIRED, "--use-distributed-optimizer", "--save", "c",
                            "--save-interval", "4"])
    if optimizer_has_fused_adam():
        check_megatron_arguments(saving)
        return
    with pytest.raises(MegatronArgumentError, match="--use-distributed-optimizer with --save"):
        check_megatron_arguments(saving)
    check_megatron_arguments(megatron_args([*MODEL_ARGS, *REQUIRED, "--use-distributed-optimizer"]))


def test_more_eval_iters_than_the_validation_set_gives_are_refused():
    assert validation_steps(4, 4, range(64), 16, explicit=True) == 4
    with pytest.raises(MegatronArgumentError,
                       match=r"--eval-iters 6: the validation set \(64 examples\) gives 4 .*"
                             r"use --eval-iters 4 or less"):
        validation_steps(6, 4, range(64), 16, explicit=True)


@requires_megatron_lm
def test_megatron_default_eval_iters_means_the_whole_validation_set(capsys):
    assert validation_steps(100, 4, range(64), 16, explicit=False) == 4
    assert "each evaluation runs the whole validation set: 4 steps" in capsys.readouterr().out


def test_megatron_arguments_complete_the_packing_config():
    packing = resolve_packing_config(PackingConfig(align_packing_bins_to_dp=True),
                                     _args(tensor_model_parallel_size=2, context_parallel_size=2,
                                           fp8="hybrid", fp8_recipe="mxfp8"),
                                     dp_size=2, explicit_keys={"align_packing_bins_to_dp"},
                                     source="sft.yaml")
    assert (packing.global_batch_size, packing.bin_capacity) == (64, 1024)
    assert (packing.tp_size, packing.cp_size) == (2, 2)
    assert (packing.fp8_enabled, packing.fp8_recipe) == (True, "mxfp8")


@pytest.mark.parametrize(("key", "value", "flag"), [
    ("global_batch_size", 32, "--global-batch-size"),
    ("tp_size", 4, "--tensor-model-parallel-size"),
    ("cp_size", 2, "--context-parallel-size"),
])
def test_a_yaml_value_that_contradicts_megatron_is_refused(key, value, flag):
    with pytest.raises(ConfigError, match=f"packing.{key} is {value}.*{flag}"):
        resolve_packing_config(PackingConfig(**{key: value}), _args(), dp_size=2,
                               explicit_keys={key}, source="sft.yaml")


def test_a_row_longer_than_the_model_sequence_is_refused():
    with pytest.raises(ConfigError, match="bin_capacity 2048 exceeds --seq-length 1024"):
        resolve_packing_config(PackingConfig(bin_capacity=2048), _args(), dp_size=2,
                               explicit_keys={"bin_capacity"}, source="sft.yaml")
    smaller = resolve_packing_config(PackingConfig(bin_capacity=512), _args(), dp_size=2,
                                     explicit_keys={"bin_capacity"}, source="sft.yaml")
    assert smaller.bin_capacity == 512


def test_padded_mode_is_taken_with_its_budget_and_megatrons_batch_size(recwarn):
    padded = resolve_packing_config(
        {"use_sequence_packing": False, "max_tokens_per_microbatch": 4096},
        _args(pipeline_model_parallel_size=1), dp_size=2,
        explicit_keys={"use_sequence_packing", "max_tokens_per_microbatch"}, source="sft.yaml")
    assert not padded.use_sequence_packing
    assert padded.padded.max_tokens_per_microbatch == 4096
    assert padded.global_batch_size == 64
    assert not recwarn.list, "Megatron's packed-row values must not reach a padded config"
    with pytest.raises(ConfigError, match="global_batch_size is 32.*--global-batch-size"):
        resolve_packing_config({"use_sequence_packing": False, "global_batch_size": 32},
                               _args(pipeline_model_parallel_size=1), dp_size=2,
                               explicit_keys={"use_sequence_packing", "global_batch_size"},
                               source="sft.yaml")


@pytest.mark.parametrize(("layout", "flag"), [
    ({"pipeline_model_parallel_size": 2}, "--pipeline-model-parallel-size 2"),
    ({"context_parallel_size": 2}, "--context-parallel-size 2"),
])
def test_padded_mode_refuses_pipeline_and_context_parallelism_by_name(layout, flag):
    args = _args(**{"pipeline_model_parallel_size": 1, **layout})
    with pytest.raises(ConfigError, match=f"padded mode.*{flag}.*use packed mode"):
        resolve_packing_config({"use_sequence_packing": False}, args, dp_size=2,
                               explicit_keys={"use_sequence_packing"}, source="sft.yaml")


def test_padded_mode_refuses_examples_longer_than_the_model_sequence():
    check_padded_lengths([10, 200, 300], 300, "sft.yaml")
    with pytest.raises(ConfigError, match="1 example.*longer than --seq-length 256.*300 tokens"
                                          ".*at least 300"):
        check_padded_lengths([10, 200, 300], 256, "sft.yaml")


@requires_megatron_lm
@pytest.mark.slow
def test_refusal_comes_before_any_model_is_built(sft_data, tmp_path):
    """Virtual pipeline stages, a batch-size ramp and a warm-up as long as the run (the tests'
    --lr-warmup-iters 2 with --train-iters 2), through torchrun and the real flags."""
    yaml = write_sft_yaml(tmp_path / "sft.yaml", sft_data)
    run = launch(2, ["--packing-config", str(yaml), "--global-batch-size", "16",
                     "--train-iters", "2", "--rampup-batch-size", "8", "8", "64",
                     "--pipeline-model-parallel-size", "2",
                     "--num-layers-per-virtual-pipeline-stage", "1"],
                 tmp_path / "log", timeout=120)
    assert run.returncode != 0
    assert "--rampup-batch-size: the packing loop already varies the batch" in run.output
    assert "--num-layers-per-virtual-pipeline-stage: the interleaved pipeline schedule" in \
        run.output
    assert "--lr-warmup-iters 2 is not shorter than --train-iters 2: Megatron's scheduler" in \
        run.output
    assert "building GPT model" not in run.output
    assert "interleaved pipeline parallelism expected each model chunk" not in run.output
    # One message from rank 0, no traceback from the ranks (torchrun adds its own summary).
    assert run.output.count("megatron_packing.megatron_lm: error: Megatron-LM arguments") == 1
    assert "[rank0]: Traceback" not in run.output and "[rank1]: Traceback" not in run.output


@requires_megatron_lm
def test_only_rank_0_prints_a_refusal_and_the_other_ranks_wait_before_they_exit(monkeypatch,
                                                                               capsys):
    # torchrun ends every rank once one exits: a rank other than 0 that exited at once could
    # end a rank 0 running late before it printed the refusal.
    from megatron_packing.megatron_lm import entry

    waits: list[float] = []
    monkeypatch.setattr(entry.time, "sleep", waits.append)
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        assert entry.run(["--packing-config", "sft.yaml"]) == 2
        printed = capsys.readouterr().err
        if rank == "1":
            assert waits == [entry.REFUSAL_GRACE_S] and "error:" not in printed
        else:
            assert waits == [entry.REFUSAL_GRACE_S]  # rank 0 does not wait
            assert printed.count("megatron_packing.megatron_lm: error: Megatron-LM arguments") == 1


@pytest.mark.parametrize(("text", "message"), [
    ("packing:\n  seed: 1\n", "data.paths must be a non-empty list of dataset paths"),
    ("data:\n  paths: [train.jsonl]\n", "data.tokenizer must be a non-empty string"),
    ("packing:\n  max_tokens_per_microbatch: 4096\ndata:\n  paths: [a.jsonl]\n  tokenizer: t\n",
     "max_tokens_per_microbatch is only read in padded mode"),
    ("data:\n  paths: [a.jsonl]\n  tokenizer: tok\n  valid_path: [b.jsonl]\n", "valid_path"),
    ("- packing\n", "expected a mapping of keys at the top level"),
])
def test_the_training_yaml_is_checked(tmp_path, text, message):
    from megatron_packing.megatron_lm.entry import read_packing_yaml

    path = tmp_path / "sft.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        read_packing_yaml(str(path))


def test_the_trainers_sections_are_warned_about_by_name(tmp_path):
    """train: and model: have no effect under the entry point (its arguments set them)."""
    from megatron_packing.config.mode_keys import UnusedKeyWarning
    from megatron_packing.megatron_lm.entry import read_packing_yaml

    path = tmp_path / "sft.yaml"
    path.write_text("packing:\n  seed: 7\ndata:\n  paths: [a.jsonl]\n  tokenizer: tok\n"
                    "train:\n  steps: 5\nmodel:\n  num_layers: 2\n")
    with pytest.warns(UnusedKeyWarning, match="the sections model, train have no effect on the "
                                              "Megatron-LM entry point"):
        packing, _, data = read_packing_yaml(str(path))
    assert packing == {"seed": 7} and data.paths == ["a.jsonl"]


def test_the_training_yaml_reports_the_packing_keys_it_sets(tmp_path):
    from megatron_packing.megatron_lm.entry import read_packing_yaml

    path = tmp_path / "sft.yaml"
    path.write_text("packing:\n  seed: 7\n  bin_capacity: 512\n"
                    "data:\n  paths: [a.jsonl]\n  tokenizer: tok\n  valid_paths: [b.jsonl]\n")
    packing, explicit, data = read_packing_yaml(str(path))
    assert packing == {"seed": 7, "bin_capacity": 512}
    assert explicit == {"seed", "bin_capacity"}
    assert data.valid_paths == ["b.jsonl"]


def test_the_packing_section_is_judged_once_megatron_completes_it(tmp_path):
    """An FP8 recipe in the YAML needs FP8 on, which only Megatron's --fp8-format says."""
    from megatron_packing.megatron_lm.entry import read_packing_yaml

    path = tmp_path / "sft.yaml"
    path.write_text("packing:\n  fp8_recipe: mxfp8\n  align_packing_bins_to_dp: true\n"
                    "data:\n  paths: [a.jsonl]\n  tokenizer: tok\n")
    section, explicit, _ = read_packing_yaml(str(path))
    packing = resolve_packing_config(section, _args(fp8="hybrid", fp8_recipe="mxfp8"), dp_size=2,
                                     explicit_keys=explicit, source=str(path))
    assert (packing.fp8_enabled, packing.fp8_recipe, packing.bin_capacity) == (True, "mxfp8", 1024)
    with pytest.raises(ConfigError, match=f"{path}: fp8_recipe='mxfp8' is set but fp8_enabled is False"):
        resolve_packing_config(section, _args(), dp_size=2, explicit_keys=explicit,
                               source=str(path))
    path.write_text("packing:\n  bin_capcity: 512\ndata:\n  paths: [a.jsonl]\n  tokenizer: tok\n")
    with pytest.raises(ConfigError, match="did you mean 'bin_capacity'"):
        read_packing_yaml(str(path))


@requires_megatron_lm
def test_moe_is_refused_where_megatron_cores_router_cannot_run(monkeypatch):
    from megatron.core.transformer.moe import moe_utils

    args = megatron_args([*MODEL_ARGS, *REQUIRED, "--num-experts", "4"])
    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    with pytest.raises(MegatronArgumentError, match="--num-experts: this megatron-core's MoE "
                                                    "router calls Transformer Engine's GEMM"):
        check_megatron_arguments(args)
    monkeypatch.setattr(moe_utils, "te_general_gemm", None, raising=False)
    check_megatron_arguments(args)


@requires_megatron_lm
def test_sequence_parallelism_is_refused_where_the_local_layers_cannot_run_it(monkeypatch):
    """Without Apex, megatron-core's local layers normalise with torch's LayerNorm, which asserts
    on sequence parallelism while the model is being built (seen through the entry point)."""
    from megatron.core.models.gpt import gpt_layer_specs

    args = megatron_args([*MODEL_ARGS, *REQUIRED, "--tensor-model-parallel-size", "2",
                          "--sequence-parallel"])
    monkeypatch.setattr(gpt_layer_specs, "HAVE_APEX", False)
    with pytest.raises(MegatronArgumentError,
                       match="--sequence-parallel with --tensor-model-parallel-size 2 and "
                             "--transformer-impl local: without Apex"):
        check_megatron_arguments(args)
    check_megatron_arguments(megatron_args([*MODEL_ARGS, *REQUIRED, "--sequence-parallel"]))
    monkeypatch.setattr(gpt_layer_specs, "HAVE_APEX", True)
    check_megatron_arguments(args)


def _budget_args(**overrides):
    values = dict(packing_budget_file=None, packing_budget_check_interval=1, save=None)
    values.update(overrides)
    return SimpleNamespace(**values)


@requires_megatron_lm
def test_the_budget_arguments_are_honoured_or_refused(tmp_path):
    from megatron_packing.megatron_lm.entry import _budget_controller

    packed = PackingConfig()
    with pytest.raises(ConfigError, match="--packing-budget-file .* only padded mode"):
        _budget_controller(_budget_args(packing_budget_file="b.json"), packed, None)
    assert _budget_controller(_budget_args(), packed, None) is None
    padded = PackingConfig(use_sequence_packing=False, max_tokens_per_microbatch=4096)
    with pytest.raises(ConfigError, match="--packing-budget-check-interval 0"):
        _budget_controller(_budget_args(packing_budget_check_interval=0), padded, None)
    loader = SimpleNamespace(batch_sampler=None)
    controller = _budget_controller(_budget_args(save=str(tmp_path),
                                                 packing_budget_check_interval=5), padded, loader)
    assert controller.control_file == tmp_path / "token_budget.json"
    assert controller.check_every == 5
    assert controller.budget_at(0) == 4096
    named = _budget_controller(_budget_args(packing_budget_file=str(tmp_path / "x.json")),
                               padded, loader)
    assert named.control_file == tmp_path / "x.json"
