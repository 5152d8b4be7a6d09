"""Which GPT builder the entry point uses, and the library's own provider: it needs no
Megatron-LM checkout (megatron-core 0.19's wheel ships megatron.training), and with a checkout it
builds the model Megatron-LM's gpt_builder builds (same losses, step for step)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
from megatron_lm_runs import MEGATRON_LM, launch, requires_megatron_lm, write_sft_yaml

from megatron_packing.megatron_lm import model


def _find_spec_with(present: set[str], monkeypatch) -> None:
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name in model.CHECKOUT_MODULES:
            return object() if name in present else None
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.mark.parametrize(("present", "chosen"), [
    ({"model_provider", "gpt_builders"}, "megatron-lm"),
    ({"model_provider"}, "project"),
    (set(), "project"),
])
def test_auto_takes_the_checkouts_builder_only_when_both_modules_import(present, chosen,
                                                                       monkeypatch):
    _find_spec_with(present, monkeypatch)
    assert model.chosen_provider("auto") == chosen
    assert model.chosen_provider("project") == "project"
    assert model.chosen_provider("megatron-lm") == "megatron-lm"


def test_an_unknown_provider_is_refused_by_name():
    with pytest.raises(ValueError, match="--packing-model-provider 'gpt2': use one of auto, "
                                         "megatron-lm, project"):
        model.chosen_provider("gpt2")


def test_naming_the_checkouts_builder_without_a_checkout_is_refused(monkeypatch):
    _find_spec_with({"model_provider"}, monkeypatch)
    problems = model.provider_refusals(SimpleNamespace(), "megatron-lm")
    assert problems == ["--packing-model-provider megatron-lm: gpt_builders not importable; "
                        "put a Megatron-LM checkout (the folder holding model_provider.py and "
                        "gpt_builders.py) on PYTHONPATH, or use --packing-model-provider project"]


def test_builder_only_arguments_are_refused_with_the_librarys_provider():
    args = SimpleNamespace(spec=["my.spec", "layer"], yaml_cfg=None, use_kitchen=True)
    problems = model.provider_refusals(args, "project")
    assert [p.split(":")[0] for p in problems] == ["--spec", "--use-kitchen"]
    assert all("--packing-model-provider megatron-lm" in p for p in problems)
    assert model.provider_refusals(SimpleNamespace(), "project") == []


ARGS = ["--global-batch-size", "8", "--train-iters", "3"]


def _losses(run) -> list[float]:
    assert run.returncode == 0, run.output[-4000:]
    return [step["loss"] for step in run.steps()]


@requires_megatron_lm
@pytest.mark.slow
def test_the_librarys_provider_trains_without_a_checkout_or_as_megatron_lms_builder(
        sft_data, tmp_path):
    yaml = write_sft_yaml(tmp_path / "sft.yaml", sft_data)
    ours = launch(1, ["--packing-config", str(yaml), *ARGS, "--packing-model-provider",
                      "project"], tmp_path / "project")
    assert "GPT model from megatron_packing's provider (megatron-core layer specs)" in ours.output
    losses = _losses(ours)
    assert len(losses) == 3 and all(loss > 0 for loss in losses)
    if MEGATRON_LM is None:  # no checkout: naming its builder is refused before building
        refused = launch(1, ["--packing-config", str(yaml), *ARGS, "--packing-model-provider",
                             "megatron-lm"], tmp_path / "refused")
        assert refused.returncode != 0
        assert "exitcode  : 2" in refused.output  # the rank's status: a refusal, not a fault
        assert "--packing-model-provider megatron-lm: model_provider and gpt_builders not " \
               "importable" in refused.output
        assert not refused.steps()
        return
    theirs = launch(1, ["--packing-config", str(yaml), *ARGS], tmp_path / "megatron_lm")
    assert "GPT model from Megatron-LM's model_provider + gpt_builders (checkout)" in theirs.output
    assert losses == _losses(theirs)  # the same model, initialised the same: the same losses
