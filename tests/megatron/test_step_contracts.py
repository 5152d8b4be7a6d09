"""The two contracts a varying micro-batch count puts on a step, checked in milliseconds.

With a small fake schedule (what megatron-core's schedule does with
``calculate_per_token_loss``: backward each micro-batch's returned loss as is, then divide the
gradient once by the summed token count) and megatron-core's real LR scheduler:

- the gradient is the global token mean's, whatever the micro-batches' sizes (a loss divided
  per micro-batch weights a token by its row's size and fails here);
- the LR schedule moves by real examples, so a run sized in examples ends exactly at its
  minimum LR (stepping by rows, which vary with packing, ends elsewhere).
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_packing.common.plan_types import StepMetadata
from megatron_packing.megatron.loss import make_loss_func
from megatron_packing.megatron.step_accounting import lr_increment, megatron_lm_loss_func


def fake_schedule(rows: list[torch.Tensor], weight: torch.Tensor, loss_for_row) -> torch.Tensor:
    """Backward every row's returned loss unscaled, then divide the gradient by the tokens."""
    weight.grad = None
    tokens = 0
    for row in rows:
        loss, count, _ = loss_for_row(row, weight * row)
        loss.backward()
        tokens += int(count)
    return weight.grad / max(tokens, 1)


rows_strategy = st.lists(st.lists(st.floats(-4, 4, allow_nan=False, width=32), min_size=1,
                                  max_size=9), min_size=2, max_size=6)


def as_rows(values: list[list[float]]) -> list[torch.Tensor]:
    return [torch.tensor(v, dtype=torch.float64) for v in values]


@settings(max_examples=40, deadline=None)
@given(rows_strategy)
def test_the_megatron_lm_loss_gives_the_global_token_mean_gradient(values):
    rows, weight = as_rows(values), torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    gradient = fake_schedule(rows, weight, lambda row, out: megatron_lm_loss_func(
        torch.ones_like(row), out))
    expected = torch.cat(rows).mean()  # d/dw of mean(w x) over every token of the step
    assert torch.allclose(gradient, expected, rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(rows_strategy)
def test_the_demo_loss_gives_the_global_token_mean_gradient(values):
    rows, weight = as_rows(values), torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    n = sum(len(v) for v in values)

    weight.grad = None
    for row in rows:  # the loss is already divided by the step's N: nothing divides again
        loss, _, _ = make_loss_func(torch.ones_like(row), n)(weight * row)
        loss.backward()
    assert torch.allclose(weight.grad, torch.cat(rows).mean(), rtol=1e-12, atol=1e-12)


def test_a_worked_step_of_unequal_rows():
    # rows of 1 and 3 tokens: the token mean is (4 + 2 + 2 + 2) / 4 = 2.5; a loss divided per
    # row would give (4 + 2) / 4 = 1.5
    rows = as_rows([[4.0], [2.0, 2.0, 2.0]])
    weight = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    gradient = fake_schedule(rows, weight, lambda row, out: megatron_lm_loss_func(
        torch.ones_like(row), out))
    assert gradient.item() == 2.5


def meta(examples: int, bins: int) -> StepMetadata:
    return StepMetadata(step=0, epoch=0, num_examples=examples, num_tokens=examples * 10,
                        num_loss_tokens=examples * 5, num_bins=bins, num_padding_bins=0,
                        num_placeholder_bins=0, micro_batches_per_rank=bins // 2, token_fill=1.0,
                        dp_imbalance=1.0, plan_ms=0.0, aligned=True)


def megatron_scheduler(decay_samples: int):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return optimizer, OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=1.0, min_lr=0.1, lr_warmup_steps=0,
        lr_decay_steps=decay_samples, lr_decay_style="cosine", start_wd=0.0, end_wd=0.0,
        wd_incr_steps=decay_samples, wd_incr_style="constant")


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 8)), min_size=1, max_size=12))
def test_the_lr_ends_at_min_lr_after_the_runs_examples(steps):
    steps = [meta(examples, 2 * bins) for examples, bins in steps]
    optimizer, scheduler = megatron_scheduler(sum(m.num_examples for m in steps))
    for m in steps:
        scheduler.step(increment=lr_increment(m))
    assert math.isclose(optimizer.param_groups[0]["lr"], 0.1, rel_tol=1e-12)


def test_a_worked_run_steps_by_examples_not_rows():
    optimizer, scheduler = megatron_scheduler(100)
    scheduler.step(increment=lr_increment(meta(examples=50, bins=8)))  # halfway through
    assert math.isclose(optimizer.param_groups[0]["lr"], 0.1 + 0.9 * 0.5, rel_tol=1e-12)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 8)), min_size=1, max_size=12),
       st.integers(0, 30))
def test_the_demo_schedule_steps_by_examples_and_ends_at_min_lr(steps, warmup):
    """The CPU demo's schedule is megatron-core's, sized and stepped in examples."""
    from megatron_packing.demo.train_step import example_schedule, step_schedule

    steps = [meta(examples, 2 * bins) for examples, bins in steps]
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    total = sum(m.num_examples for m in steps)
    scheduler = example_schedule(optimizer, lr=1.0, min_lr=0.1, weight_decay=0.01,
                                 warmup_examples=warmup, total_examples=total)
    for m in steps:
        step_schedule(scheduler, m)
    assert scheduler.num_steps == total
    assert math.isclose(optimizer.param_groups[0]["lr"], 0.1, rel_tol=1e-12)
    assert optimizer.param_groups[0]["weight_decay"] == 0.01
