"""Library fault catalogue: wrong resumes, empty states, bad configs, ignored options, empty data.

Each case is a silent wrong result or an unclear crash that must now be either correct
behaviour or a clear error naming the field / file / value; the expected message is asserted.
"""

from __future__ import annotations

import re
import warnings

import pytest
from loader.streams import DATASET, config, record
from sampler.synthetic import SyntheticSFT, mixed_lengths
from torch.utils.data import SequentialSampler

from megatron_packing.config import ConfigError, PackingConfig, load_config
from megatron_packing.loader.dataloader import PackingDataLoader, build_sft_dataloader
from megatron_packing.packed.collate import PackedCollator
from megatron_packing.packed.components import build_packing_sampler
from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler
from megatron_packing.padded.sampler import TokenBudgetBatchSampler
from megatron_packing.stream.fetch import PlannedDataset

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
SEED = 11


def loader(dataset=DATASET, seed=SEED, dp_rank=1, dp_size=2, num_workers=0, **overrides):
    return build_sft_dataloader(dataset, config(**overrides), dp_rank=dp_rank, dp_size=dp_size,
                                seed=seed, num_workers=num_workers)


def state_after(steps: int, **options) -> dict:
    source = loader(**options)
    batches = iter(source)
    for _ in range(steps):
        next(batches)
    return source.state_dict()


def flat_stream(source, iterations: int) -> list[tuple]:
    """The records of ``iterations`` passes over the loader (each pass: the rest of an epoch)."""
    return [record(b) for _ in range(iterations) for b in source]


# --------------------------------------------------------------------------- item 1
OTHER_LENGTHS = SyntheticSFT(mixed_lengths(160, seed=6, high=700))  # same size, other lengths
SHORTER = SyntheticSFT(mixed_lengths(150, seed=5, high=700))

ORDER_CHANGES = [
    # (id, options of the resumed loader, the field as the refusal names it: the key a user sets,
    # saved value, new value)
    ("seed", dict(seed=12), "seed", SEED, 12),
    ("base_order", dict(base_order="sequential"), r"base_order \(the base sampler\)",
     "SeededRandomOrder", "SequentialSampler"),
    ("dataset_lengths", dict(dataset=OTHER_LENGTHS), r"the examples' lengths \(sha256; the data "
     r"or its tokenization changed\)", None, None),
    ("dataset_size", dict(dataset=SHORTER), "the number of examples", 160, 150),
    ("global_batch_size", dict(global_batch_size=32), "global_batch_size", 30, 32),
    ("variation", dict(packing_batch_size_allowed_variation=0.2),
     r"packing_batch_size_allowed_variation \(as v, in examples\)", 3, 6),
    ("bin_capacity", dict(bin_capacity=2048), "bin_capacity", 1024, 2048),
    ("algorithm", dict(packing_algorithm="bfd"), "packing_algorithm", "mffd", "bfd"),
    ("align_to_dp", dict(align_packing_bins_to_dp=False), "align_packing_bins_to_dp", True, False),
    ("fp8", dict(fp8_enabled=True), "tp_size, cp_size, fp8_enabled, fp8_recipe",
     [1, 1, False, None], [1, 1, True, None]),
    ("lookahead", dict(lookahead_steps=1), "lookahead_steps", 6, 1),
    ("oversize_policy", dict(oversize_policy="own_bin"), "oversize_policy", "error", "own_bin"),
    ("rank_assignment", dict(rank_assignment="round_robin"), "rank_assignment",
     "rebalanced", "round_robin"),
]


@pytest.mark.parametrize("options, field, saved, now",
                         [case[1:] for case in ORDER_CHANGES], ids=[c[0] for c in ORDER_CHANGES])
def test_resume_refuses_a_change_of_an_order_deciding_setting(options, field, saved, now):
    state = state_after(2)
    resumed = loader(**options)
    expected = f"{field}: saved " + ("" if saved is None else re.escape(f"{saved!r}, now {now!r}"))
    with pytest.raises(ValueError, match=rf"cannot resume: .*different setup.*{expected}"):
        resumed.load_state_dict(state)  # refused at once, not at the first iteration


def test_resume_refuses_another_seed_at_the_sampler_too():
    def sampler(seed):
        return build_packing_sampler(DATASET, config(), dp_rank=0, dp_size=2, seed=seed)

    first = sampler(1)
    next(iter(first))
    with pytest.raises(ValueError, match="seed: saved 1, now 2"):
        sampler(2).load_state_dict(first.state_dict())


def test_an_identical_setup_resumes_bit_exactly():
    reference = flat_stream(loader(), 2)
    resumed = loader()
    resumed.load_state_dict(state_after(2))
    assert flat_stream(resumed, 2) == reference[2:]


# --------------------------------------------------------------------------- item 11
def padded_sampler():
    return TokenBudgetBatchSampler(SequentialSampler(range(8)), [5] * 8, 4, 2, dp_rank=0)


def packed_sampler():
    return DPAlignedPackingBatchSampler(SequentialSampler(range(8)), [5] * 8, 4, 2,
                                        bin_capacity=16, allowed_variation=0.25, dp_rank=0)


@pytest.mark.parametrize("make", [packed_sampler, padded_sampler, loader],
                         ids=["packed_sampler", "padded_sampler", "loader"])
@pytest.mark.parametrize("state", [{}, None], ids=["empty", "none"])
def test_loading_an_empty_or_missing_state_is_refused(make, state):
    with pytest.raises(ValueError, match=r"state_dict\(\) returned.*do not load a state at all"):
        make().load_state_dict(state)


def test_a_partial_sampler_state_names_the_missing_keys():
    state = packed_sampler().state_dict()
    del state["carry"], state["drift"]
    with pytest.raises(ValueError, match="a dict without carry, drift"):
        packed_sampler().load_state_dict(state)


def test_a_loader_state_without_a_sampler_state_is_refused():
    with pytest.raises(ValueError, match="not a StatefulDataLoader state"):
        loader().load_state_dict({"step": 3})


# --------------------------------------------------------------------------- item 12 + YAML
def write(tmp_path, text: str, name: str = "train.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_fp8_recipe_without_fp8_enabled_is_refused(tmp_path):
    path = write(tmp_path, "packing:\n  fp8_recipe: mxfp8\n")
    with pytest.raises(ConfigError, match=re.escape(str(path)) + ".*fp8_recipe='mxfp8' is set but "
                       "fp8_enabled is False.*set fp8_enabled: true, or remove fp8_recipe"):
        load_config(path)
    with pytest.raises(ConfigError, match="fp8_enabled"):
        PackingConfig(fp8_recipe="delayed").validate()
    assert PackingConfig(fp8_enabled=True, fp8_recipe="mxfp8", bin_capacity=4096).validate()


@pytest.mark.parametrize("text, kind", [
    ("- global_batch_size: 64\n- bin_capacity: 1024\n", "list"),
    ("[]\n", "list"),
    ("42\n", r"scalar \(int\)"),
    ("just words\n", "string"),
])
def test_a_top_level_list_or_scalar_is_refused(tmp_path, text, kind):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(str(path)) + ": expected a mapping of keys at "
                       f"the top level.*got a YAML {kind}"):
        load_config(path)


def test_a_packing_section_that_is_not_a_mapping_is_refused(tmp_path):
    path = write(tmp_path, "packing:\n  - 1\n  - 2\n")
    with pytest.raises(ConfigError, match=re.escape(str(path)) + ".*expected a mapping.*got list"):
        load_config(path)


@pytest.mark.parametrize("text, line", [
    ("packing:\n  global_batch_size: 64\n  seed: [1, 2\n", 4),
    ("packing:\n  global_batch_size: 64\n\tbin_capacity: 1024\n", 3),
    ("packing:\n  a: 1\n b: 2\n", 3),
])
def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path, text, line):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(f"{path}:{line}:") + r"\d+: YAML syntax error: "):
        load_config(path)


# --------------------------------------------------------------------------- item 13
PADDED = dict(use_sequence_packing=False, align_packing_bins_to_dp=False, micro_batch_size=2)


class Reversed(SequentialSampler):
    def __iter__(self):
        return iter(range(len(self) - 1, -1, -1))


def padded_global_order(**options) -> tuple[list[int], list]:
    """Every step's global batch (both ranks' examples, in order) and the metadata."""
    loaders = [build_sft_dataloader(DATASET, config(**PADDED), dp_rank=r, dp_size=2, seed=SEED,
                                    **options) for r in range(2)]
    order, metas = [], []
    for batches in zip(*loaders, strict=True):
        order.extend(i for b in batches for i in b.example_indices)
        metas.append(batches[0].meta)
    return order, metas


def test_padded_mode_honours_total_steps():
    order, metas = padded_global_order(total_steps=2)
    assert [m.step for m in metas] == [0, 1] and len(order) == 60
    _, full = padded_global_order()
    assert len(full) == 6


def test_padded_mode_eval_reads_one_whole_epoch_in_sequential_order():
    order, metas = padded_global_order(eval_mode=True, total_steps=2)
    assert order == list(range(len(DATASET)))
    assert all(m.is_eval for m in metas) and len(metas) == 6


def test_padded_mode_uses_the_given_base_sampler():
    order, metas = padded_global_order(base_sampler=Reversed(range(len(DATASET))))
    assert order == list(range(len(DATASET) - 1, -1, -1))
    assert not any(m.is_eval for m in metas)


def test_padded_mode_refuses_a_resume_with_another_seed():
    first = build_sft_dataloader(DATASET, config(**PADDED), dp_rank=0, dp_size=2, seed=1)
    next(iter(first))
    second = build_sft_dataloader(DATASET, config(**PADDED), dp_rank=0, dp_size=2, seed=2)
    with pytest.raises(ValueError, match="seed: saved 1, now 2"):
        second.load_state_dict(first.state_dict())


# --------------------------------------------------------------------------- item 7
EMPTY = SyntheticSFT([])


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_an_empty_dataset_is_refused_when_the_loader_is_built(packing):
    options = {} if packing else PADDED
    with pytest.raises(ValueError, match="the dataset has 0 examples: nothing to train on"):
        loader(dataset=EMPTY, **options)


def test_empty_samplers_are_refused():
    with pytest.raises(ValueError, match="the dataset has 0 examples"):
        DPAlignedPackingBatchSampler(SequentialSampler(range(0)), [], 4, 2, bin_capacity=16,
                                     allowed_variation=0.25)
    with pytest.raises(ValueError, match="the dataset has 0 examples"):
        TokenBudgetBatchSampler(SequentialSampler(range(0)), [], 4, 2, dp_rank=0)


def test_a_fully_skipped_dataset_names_the_skips(tmp_path):
    from data.sft_test_data import CONVERSATIONS, make_tokenizer, write_jsonl

    from megatron_packing.data import load_sft_dataset

    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": c} for c in CONVERSATIONS[:2]]
                       + [{"messages": []}])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dataset = load_sft_dataset(path, make_tokenizer(), cache_dir=tmp_path / "c", max_length=5,
                                   on_bad_record="skip", show_progress=False)
    assert len(dataset) == 0
    with pytest.raises(ValueError, match=r"0 examples \(3 skipped: empty_conversation=1, "
                       r"no_loss_tokens=2\): nothing to train on"):
        loader(dataset=dataset)


# --------------------------------------------------------------------------- num_workers
@pytest.mark.parametrize("saved_with, resumed_with, steps", [
    (0, 2, 2), (2, 0, 2), (2, 0, 6), (0, 2, 6), (2, 3, 4),
], ids=["0to2", "2to0", "2to0_epoch_end", "0to2_epoch_end", "2to3"])
def test_resume_with_another_num_workers_equals_the_uninterrupted_stream(saved_with, resumed_with,
                                                                        steps):
    reference = flat_stream(loader(), 3)
    resumed = loader(num_workers=resumed_with)
    resumed.load_state_dict(state_after(steps, num_workers=saved_with))
    got = flat_stream(resumed, 2)  # the rest of this epoch (none at its end), then a whole one
    assert len(got) == (12 - steps if steps < 6 else 12)
    assert got == reference[steps:steps + len(got)]


def test_a_state_from_a_finished_epoch_moves_between_worker_counts():
    reference = flat_stream(loader(), 2)
    source = loader(num_workers=2)
    assert len(flat_stream(source, 1)) == 6
    resumed = loader()
    resumed.load_state_dict(source.state_dict())
    assert flat_stream(resumed, 1) == reference[6:]


def take(source, count: int) -> list[tuple]:
    """The next ``count`` steps, crossing epochs as a training loop does."""
    out: list[tuple] = []
    while True:
        for batch in source:
            out.append(record(batch))
            if len(out) == count:
                return out


def test_several_resumes_alternating_worker_counts():
    reference = flat_stream(loader(), 3)
    got, state = [], None
    for workers, steps in [(0, 2), (2, 3), (0, 2), (2, 5), (3, 4), (0, 2)]:
        current = loader(num_workers=workers)
        if state is not None:
            current.load_state_dict(state)
        got += take(current, steps)
        state = current.state_dict()
    assert got == reference


def test_a_lagging_worker_snapshot_is_replayed_when_moving_to_no_workers():
    """With snapshot_every_n_steps > 1 the saved snapshot trails the yielded steps."""
    sampler = build_packing_sampler(DATASET, config(), dp_rank=1, dp_size=2, seed=SEED)
    collate = PackedCollator()
    source = PackingDataLoader(PlannedDataset(DATASET), batch_sampler=sampler, collate_fn=collate,
                               num_workers=2, snapshot_every_n_steps=4)
    batches = iter(source)
    for _ in range(3):
        next(batches)
    state = source.state_dict()
    assert state["_steps_since_snapshot"] == 3  # the case under test
    reference = flat_stream(loader(), 2)
    resumed = loader()
    resumed.load_state_dict(state)
    assert flat_stream(resumed, 2) == reference[3:]
