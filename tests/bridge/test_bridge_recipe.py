"""The Bridge host's start-up checks and its loader-state file, in process (no launch): what a
recipe may not ask for, the packing section read against the recipe's own fields, and the loader
state read back through Bridge's restricted unpickler."""

from __future__ import annotations

from pathlib import Path

import pytest
from bridge_runs import BRIDGE_SKIP, requires_bridge

from megatron_packing.bridge.recipe import (
    RecipeRefused,
    bridge_version,
    check_bridge_version,
)
from megatron_packing.config import ConfigError

pytestmark = pytest.mark.bridge


@pytest.fixture(autouse=True)
def _bridge_imports():
    """``import megatron.bridge`` without Transformer Engine (`bridge_shims`, imports only)."""
    if BRIDGE_SKIP is None:
        import bridge_shims

        bridge_shims.install_import_shims()


def test_a_bridge_release_outside_the_tested_range_is_refused_by_number():
    check_bridge_version((0, 6, 2))
    for found in ((0, 5, 3), (0, 7, 0), (1, 0)):
        with pytest.raises(RecipeRefused, match=r"megatron-bridge .* outside the tested range; "
                                                r"install megatron-bridge >= 0\.6, < 0\.7"):
            check_bridge_version(found)
    with pytest.raises(RecipeRefused, match="megatron-bridge is not installed"):
        check_bridge_version(None)


@requires_bridge
def test_the_installed_release_is_read_from_its_metadata():
    assert bridge_version()[:2] == (0, 6)


@pytest.fixture
def recipe():
    """The tiny Bridge recipe as a user hands it to the host (``dataset = None``)."""
    if BRIDGE_SKIP is not None:
        pytest.skip(BRIDGE_SKIP)
    from tiny_recipe import tiny_gpt_config

    cfg = tiny_gpt_config(global_batch_size=16, seq_length=256, vocab_size=2816)
    cfg.dataset = None
    cfg.model.calculate_per_token_loss = True
    return cfg


def test_the_recipe_the_tests_train_passes(recipe):
    from megatron_packing.bridge.recipe import check_recipe

    check_recipe(recipe)
    recipe.model.attention_dropout = 0.1  # each DP rank's generator state is checkpointed
    recipe.rng.data_parallel_random_init = True
    check_recipe(recipe)


@pytest.mark.parametrize(("change", "named"), [
    (lambda cfg: setattr(cfg.model, "virtual_pipeline_model_parallel_size", 2),
     "model.virtual_pipeline_model_parallel_size 2"),
    (lambda cfg: setattr(cfg.train, "micro_batch_size", 2), "train.micro_batch_size 2"),
    (lambda cfg: setattr(cfg.train, "rampup_batch_size", [4, 4, 100]),
     "train.rampup_batch_size"),
    (lambda cfg: setattr(cfg.train, "train_iters", None), "train.train_iters is not set"),
    (lambda cfg: setattr(cfg.model, "calculate_per_token_loss", False),
     "model.calculate_per_token_loss is False"),
    (lambda cfg: setattr(cfg.model, "hidden_dropout", 0.1),
     "model.hidden_dropout 0.1 with rng.data_parallel_random_init False"),
])
def test_what_the_host_cannot_honour_is_refused_naming_the_field(recipe, change, named):
    from megatron_packing.bridge.recipe import check_recipe

    change(recipe)
    with pytest.raises(RecipeRefused, match=named):
        check_recipe(recipe)


def test_bridges_own_packing_and_a_dataset_the_host_would_not_read_are_refused(recipe, tmp_path):
    from megatron.bridge.data.builders.gpt_sft import GPTSFTDatasetConfig
    from megatron.bridge.data.packing.config import PackedSequenceSpecs

    from megatron_packing.bridge.recipe import check_recipe

    recipe.dataset = GPTSFTDatasetConfig(
        seq_length=256, dataset_root=str(tmp_path), enable_offline_packing=True,
        offline_packing_specs=PackedSequenceSpecs(packed_sequence_size=256))
    with pytest.raises(RecipeRefused, match="dataset.enable_offline_packing turns on "
                                            "Megatron-Bridge's own packing"):
        check_recipe(recipe)
    recipe.dataset = GPTSFTDatasetConfig(seq_length=256, dataset_root=str(tmp_path))
    with pytest.raises(RecipeRefused, match="dataset is a GPTSFTDatasetConfig, which the Bridge "
                                            "host would not read.*set dataset = None"):
        check_recipe(recipe)


def test_the_packing_section_is_completed_from_the_recipe_and_checked_by_field(recipe):
    from megatron_packing.bridge.recipe import host_settings
    from megatron_packing.megatron.packing_settings import resolve_packing_settings

    recipe.model.tensor_model_parallel_size = 2
    settings = host_settings(recipe)
    section = {"align_packing_bins_to_dp": True, "packing_batch_size_allowed_variation": 0.2}
    packing = resolve_packing_settings(section, settings, dp_size=2, explicit_keys=set(section),
                                       source="sft.yaml")
    assert (packing.global_batch_size, packing.bin_capacity, packing.tp_size) == (16, 256, 2)
    with pytest.raises(ConfigError, match="packing.global_batch_size is 32 but "
                                          "train.global_batch_size gives 16"):
        resolve_packing_settings({"global_batch_size": 32}, settings, dp_size=2,
                                 explicit_keys={"global_batch_size"}, source="sft.yaml")
    with pytest.raises(ConfigError, match="bin_capacity 512 exceeds model.seq_length 256"):
        resolve_packing_settings({"bin_capacity": 512}, settings, dp_size=2,
                                 explicit_keys={"bin_capacity"}, source="sft.yaml")
    recipe.model.pipeline_model_parallel_size = 2
    with pytest.raises(ConfigError, match="padded mode.*model.pipeline_model_parallel_size 2"):
        resolve_packing_settings({"use_sequence_packing": False}, host_settings(recipe),
                                 dp_size=1, explicit_keys={"use_sequence_packing"},
                                 source="sft.yaml")


def _stream(dp_rank: int = 0, dp_size: int = 2):
    from sampler.synthetic import SyntheticSFT, mixed_lengths

    from megatron_packing.config import PackingConfig
    from megatron_packing.loader.dataloader import build_sft_dataloader
    from megatron_packing.megatron.train_stream import TrainStream

    dataset = SyntheticSFT(mixed_lengths(200, seed=3, high=600))
    config = PackingConfig(global_batch_size=24, bin_capacity=1024,
                           align_packing_bins_to_dp=True,
                           packing_batch_size_allowed_variation=0.2)
    return TrainStream(build_sft_dataloader(dataset, config, dp_rank=dp_rank, dp_size=dp_size,
                                            seed=5, total_steps=12))


def _examples(batch) -> list:
    return [list(row.example_indices) for row in batch.micro_batches]


@requires_bridge
def test_the_loader_state_round_trips_through_bridges_restricted_unpickler(tmp_path: Path):
    """Bridge's hook writes ``{"dataloader_state_dict": save_state()}`` with torch.save; the host
    reads it back with Bridge's allow-listed unpickler and continues exactly where it stopped."""
    import torch
    from megatron.bridge.utils.safe_pickle import energon_torch_load

    stream = _stream()
    for _ in range(3):
        next(stream)
    path = tmp_path / "train_dataloader_dprank000.pt"
    torch.save({"dataloader_state_dict": stream.save_state()}, path)
    want = [_examples(next(stream)) for _ in range(3)]
    resumed = _stream()
    resumed.load_state_dict(energon_torch_load(str(path))["dataloader_state_dict"])
    assert [_examples(next(resumed)) for _ in range(3)] == want
    assert resumed.counter.examples == stream.counter.examples


@requires_bridge
def test_the_host_reads_the_per_rank_files_and_refuses_a_missing_or_incomplete_set(tmp_path):
    import torch
    from megatron.bridge.training.utils.checkpoint_utils import get_checkpoint_name

    from megatron_packing.bridge import loader_state

    saved = [_stream(0), _stream(1)]
    for stream in saved:
        for _ in range(2):
            next(stream)
    base = Path(get_checkpoint_name(str(tmp_path), 2))
    base.mkdir(parents=True)
    with pytest.raises(loader_state.LoaderStateRefused, match="no packing loader state"):
        loader_state.restore(_stream(), str(tmp_path), 2, dp_rank=0, dp_size=2,
                             consumed_samples=0)
    torch.save({"dataloader_state_dict": saved[1].save_state()},
               base / "train_dataloader_dprank001.pt")
    with pytest.raises(loader_state.LoaderStateRefused, match=r"ranks \[1\], not 0..1"):
        loader_state.restore(_stream(1), str(tmp_path), 2, dp_rank=1, dp_size=2,
                             consumed_samples=0)
    torch.save({"dataloader_state_dict": saved[0].save_state()},
               base / "train_dataloader_dprank000.pt")
    consumed = saved[0].counter.examples
    with pytest.raises(loader_state.LoaderStateRefused, match="counts .* examples but the "
                                                              "checkpoint's consumed"):
        loader_state.restore(_stream(1), str(tmp_path), 2, dp_rank=1, dp_size=2,
                             consumed_samples=consumed + 1)
    stream = _stream(1)
    note = loader_state.restore(stream, str(tmp_path), 2, dp_rank=1, dp_size=2,
                                consumed_samples=consumed)
    assert "train_dataloader_dprank001.pt" in note
    assert _examples(next(stream)) == _examples(next(saved[1]))


@requires_bridge
def test_a_run_at_another_data_parallel_size_plans_the_rest_from_dp_rank_0s_file(tmp_path):
    """Saved at DP 2, resumed at DP 1: the one rank reads DP rank 0's file and continues with
    the examples the DP-2 run had not trained, none repeated."""
    import torch
    from megatron.bridge.training.utils.checkpoint_utils import get_checkpoint_name

    from megatron_packing.bridge import loader_state

    saved = [_stream(0), _stream(1)]
    trained: list[int] = []
    for stream in saved:
        for _ in range(3):
            trained += [i for row in _examples(next(stream)) for i in row]
    base = Path(get_checkpoint_name(str(tmp_path), 3))
    base.mkdir(parents=True)
    for rank, stream in enumerate(saved):
        torch.save({"dataloader_state_dict": stream.save_state()},
                   base / f"train_dataloader_dprank{rank:03d}.pt")
    resumed = _stream(0, dp_size=1)
    note = loader_state.restore(resumed, str(tmp_path), 3, dp_rank=0, dp_size=1,
                                consumed_samples=saved[0].counter.examples)
    assert "train_dataloader_dprank000.pt" in note and "data-parallel size 2, now 1" in note
    later = [i for _ in range(3) for row in _examples(next(resumed)) for i in row]
    assert later and not set(later) & set(trained)


def test_a_recipe_the_host_cannot_honour_is_refused_in_one_line(recipe, tmp_path, capsys):
    """`run` says a user's mistake in one line on global rank 0 and returns 2, before Bridge
    initialises anything (no traceback through the library)."""
    from megatron_packing.bridge.entry import run

    demo = Path(__file__).resolve().parents[2] / "examples"
    yaml = tmp_path / "sft.yaml"
    yaml.write_text(f"packing:\n  align_packing_bins_to_dp: true\ndata:\n"
                    f"  paths: [{demo / 'data' / 'demo_chat.jsonl'}]\n"
                    f"  tokenizer: {demo / 'tokenizer'}\n")
    recipe.train.micro_batch_size = 2
    assert run(recipe, yaml) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megatron_packing.bridge: error: ")
    assert "train.micro_batch_size 2" in err[0] and "set it to 1" in err[0]


@requires_bridge
def test_bridge_imports_while_transformer_engine_and_nvrx_stay_absent_for_everyone_else():
    """The stand-ins are served to the two Bridge modules that import TE / NVRx at module top,
    and to nobody else: afterwards both packages are still absent and megatron-core still sees
    no TE."""
    import importlib.util
    import sys

    import megatron.bridge.peft.lora_layers  # noqa: F401
    import megatron.bridge.training.pretrain  # noqa: F401
    from megatron.core.tensor_parallel import random as tp_random

    for package in ("transformer_engine", "nvidia_resiliency_ext"):
        assert importlib.util.find_spec(package) is None, package
        assert package not in sys.modules, package
    assert tp_random.HAVE_TE is False
