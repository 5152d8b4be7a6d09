"""Padded-mode sampler and collator: plans, equal counts, collation, loader resume."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from padded_synth import SyntheticSFTDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from megatron_packing.config import PackingConfig
from megatron_packing.padded.collate import PaddedCollator, make_dummy_microbatch
from megatron_packing.padded.components import build_padded_components
from megatron_packing.padded.sampler import TokenBudgetBatchSampler
from megatron_packing.stream.base_order import SeededRandomOrder, SequentialSampler
from megatron_packing.stream.fetch import PlannedDataset, PlannedExamples

DATA = SyntheticSFTDataset(300, seed=1)


def make_sampler(rank, dp=4, budget=1200, batch=64, **kwargs):
    return TokenBudgetBatchSampler(
        SeededRandomOrder(len(DATA), seed=7), DATA.lengths, batch, dp, dp_rank=rank,
        max_tokens_per_microbatch=budget, loss_token_counts=DATA.loss_token_counts, **kwargs,
    )


def test_ranks_share_the_global_batch_with_equal_microbatch_counts():
    per_rank = [list(make_sampler(rank)) for rank in range(4)]
    everyone = list(make_sampler(None))
    assert len(everyone) == 5 == len(make_sampler(0))  # ceil(300 / 64)
    seen = []
    for step in range(5):
        plans = [per_rank[rank][step] for rank in range(4)]
        assert len({plan.microbatches_per_rank for plan in plans}) == 1
        assert all(len(plan.schedule) == plan.microbatches_per_rank for plan in plans)
        assert [i for plan in plans for i in plan] == list(everyone[step])
        assert [len(plan) for plan in plans] == plans[0].rank_num_examples
        for plan in plans:
            real = [g for g in plan.schedule if g is not None]
            assert sorted(i for g in real for i in g) == sorted(plan)  # each example once
            assert all(g is None for g in plan.schedule[len(real):])  # dummies at the end
            for group in real:
                assert len(group) * DATA.lengths[group].max() <= 1200 or len(group) == 1
            assert plan.global_num_examples == (64 if step < 4 else 300 - 256)
            assert plan.global_num_tokens == int(DATA.lengths[everyone[step]].sum())
            assert plan.global_num_loss_tokens == int(DATA.loss_token_counts[everyone[step]].sum())
        seen += everyone[step]
    assert sorted(seen) == list(range(300))


def test_fixed_micro_batch_size_when_no_budget():
    plans = list(make_sampler(1, budget=None, micro_batch_size=3))
    first = plans[0]
    assert first.schedule[0] == list(first[:3])  # input order, no sorting
    assert first.microbatches_per_rank == 6  # 16 examples per rank -> ceil(16 / 3)


def test_schedule_is_sorted_longest_first_when_budgeted():
    plan = next(iter(make_sampler(2)))
    flat = [i for g in plan.schedule if g is not None for i in g]
    assert list(DATA.lengths[flat]) == sorted(DATA.lengths[flat], reverse=True)


def test_state_dict_is_a_fresh_copy_and_resumes_exactly():
    sampler = make_sampler(3)
    iterator = iter(sampler)
    for _ in range(2):
        next(iterator)
    state = sampler.state_dict()
    frozen = pickle.dumps(state)
    rest = [list(p) + [p.schedule] for p in iterator]
    assert pickle.dumps(state) == frozen  # iterating did not change the saved state
    resumed = make_sampler(3)
    resumed.load_state_dict(pickle.loads(frozen))
    assert [list(p) + [p.schedule] for p in resumed] == rest
    with pytest.raises(ValueError, match="different setup"):
        make_sampler(3, batch=32).load_state_dict(state)


def test_epochs_advance_and_reshuffle():
    sampler = make_sampler(0)
    first = [list(p) for p in sampler]
    second = [list(p) for p in sampler]
    assert sampler.epoch == 1 and first != second
    sampler.set_epoch(0)
    assert [list(p) for p in sampler] == first


def test_budget_change_from_a_step():
    sampler = make_sampler(0)
    sampler.set_max_tokens(600, from_step=2)
    plans = list(sampler)
    assert [p.max_tokens for p in plans] == [1200, 1200, 600, 600, 600]
    with pytest.raises(ValueError, match="already planned"):
        sampler.set_max_tokens(900, from_step=1)


def test_bad_sampler_inputs():
    with pytest.raises(ValueError, match="lengths holds"):
        TokenBudgetBatchSampler(SequentialSampler(range(10)), [5] * 9, 4, 2, dp_rank=0)
    with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
        TokenBudgetBatchSampler(SequentialSampler(range(4)), [5] * 4, 4, 2, dp_rank=0,
                                max_tokens_per_microbatch=0)
    with pytest.raises(ValueError, match="dp_rank"):
        TokenBudgetBatchSampler(SequentialSampler(range(4)), [5] * 4, 4, 2, dp_rank=2)
    with pytest.raises(ValueError, match="loss_token_counts"):
        TokenBudgetBatchSampler(SequentialSampler(range(4)), [5] * 4, 4, 2, dp_rank=0,
                                loss_token_counts=[1, 2])


def test_collator_builds_padded_microbatches():
    sampler = make_sampler(1)
    plan = next(iter(sampler))
    fetched = PlannedDataset(DATA).__getitems__(plan)
    assert isinstance(fetched, PlannedExamples) and fetched.plan is plan
    batch = PaddedCollator(pad_token_id=0)(fetched)
    assert len(batch) == plan.microbatches_per_rank
    for micro, group in zip(batch.micro_batches, plan.schedule, strict=True):
        if group is None:
            assert micro is None
            continue
        assert micro.example_indices == tuple(group)
        width = int(DATA.lengths[group].max())
        assert micro.tokens.shape == (len(group), width) and micro.tokens.dtype == torch.int64
        assert micro.loss_mask.dtype == torch.float32
        for row, index in enumerate(group):
            example = DATA[index]
            n = len(example["input_ids"])
            assert torch.equal(micro.tokens[row, :n], torch.as_tensor(example["input_ids"]))
            assert torch.equal(micro.labels[row, : n - 1], torch.as_tensor(example["input_ids"][1:]))
            assert torch.equal(micro.loss_mask[row, : n - 1],
                               torch.as_tensor(example["loss_mask"][1:], dtype=torch.float32))
            assert micro.loss_mask[row, n - 1:].sum() == 0
            assert micro.attention_mask[row].sum() == n and int(micro.lengths[row]) == n
    local_loss = sum(m.num_loss_tokens for m in batch.micro_batches if m is not None)
    assert local_loss == int(DATA.loss_token_counts[list(plan)].sum())
    assert batch.meta.num_loss_tokens == plan.global_num_loss_tokens
    assert batch.meta.micro_batches_per_rank == plan.microbatches_per_rank
    assert 0 < batch.meta.token_fill <= 1
    # per-row outputs of a forward pass come back in the rank's input order
    outputs = [None if m is None else [int(i) for i in m.example_indices] for m in batch.micro_batches]
    assert batch.restore_order(outputs) == list(plan)
    with pytest.raises(TypeError, match="PlannedDataset"):
        PaddedCollator()([DATA[0]])


def test_dummy_microbatch_has_zero_loss():
    dummy = make_dummy_microbatch(pad_token_id=3)
    assert dummy.tokens.shape == (1, 1) and dummy.num_loss_tokens == 0


def _loader(num_workers, dp_rank=1):
    config = PackingConfig(use_sequence_packing=False, global_batch_size=48,
                           max_tokens_per_microbatch=1500, micro_batch_size=1, base_order="random",
                           pad_token_id=0)
    sampler, wrapper, collate = build_padded_components(DATA, config, dp_rank=dp_rank, dp_size=2, seed=11)
    return StatefulDataLoader(wrapper, batch_sampler=sampler, collate_fn=collate,
                              num_workers=num_workers, multiprocessing_context="fork" if num_workers else None)


def _fingerprint(batch):
    parts = [batch.meta.step, batch.meta.epoch, batch.example_indices]
    for micro in batch.micro_batches:
        parts.append(None if micro is None else (micro.tokens.numpy().tobytes(),
                                                 micro.labels.numpy().tobytes(),
                                                 micro.loss_mask.numpy().tobytes(),
                                                 micro.example_indices))
    return parts


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_resume_is_exact(num_workers):
    reference_loader = _loader(num_workers)
    reference = [_fingerprint(b) for b in reference_loader] + [_fingerprint(b) for b in reference_loader]
    assert len(reference) == 2 * 7  # two epochs of ceil(300 / 48) steps

    loader = _loader(num_workers)
    seen = []
    for number, batch in enumerate(loader):
        seen.append(_fingerprint(batch))
        if number == 2:
            break
    state = loader.state_dict()
    resumed = _loader(num_workers)
    resumed.load_state_dict(state)
    seen += [_fingerprint(b) for b in resumed] + [_fingerprint(b) for b in resumed]
    assert seen == reference


def test_build_padded_components_follows_config():
    config = PackingConfig(use_sequence_packing=False, global_batch_size=48,
                           max_tokens_per_microbatch=None, micro_batch_size=2,
                           base_order="sequential", pad_token_id=5)
    sampler, wrapper, collate = build_padded_components(DATA, config, dp_rank=0, dp_size=2, seed=0)
    plan = next(iter(sampler))
    assert list(plan) == list(range(24)) and plan.microbatches_per_rank == 12
    batch = collate(wrapper.__getitems__(plan))
    assert batch.micro_batches[0].tokens.shape[0] == 2
    assert np.all(batch.micro_batches[0].tokens.numpy()[batch.micro_batches[0].attention_mask.numpy() == 0] == 5)


@pytest.mark.parametrize(("dp", "dp_new"), [(4, 2), (2, 3)])
def test_a_resume_at_another_dp_size_plans_the_rest_at_that_size(dp, dp_new):
    """The saved position (order, step, budget changes) is global: the next steps are those a
    fresh sampler at the new size plans from it, with equal counts, each example once."""
    saving = [make_sampler(rank, dp=dp) for rank in range(dp)]
    saving[0].set_max_tokens(900, from_step=3)
    steps = [iter(sampler) for sampler in saving]
    head = [i for _ in range(2) for it in steps for i in next(it)]
    state = saving[0].state_dict()
    resumed = [make_sampler(rank, dp=dp_new) for rank in range(dp_new)]
    for sampler in resumed:
        sampler.load_state_dict(state)
    fresh = make_sampler(None, dp=dp_new)
    fresh.load_state_dict(state)
    tail = []
    for plans, whole in zip(zip(*resumed, strict=True), fresh, strict=True):
        assert len({plan.microbatches_per_rank for plan in plans}) == 1
        assert {plan.dp_size for plan in plans} == {dp_new}
        assert [i for plan in plans for i in plan] == list(whole)
        assert plans[0].max_tokens == (1200 if plans[0].step < 3 else 900)
        tail += list(whole)
    assert sorted(head + tail) == list(range(300))
