"""Megatron-LM adapter: the num-microbatches calculator follows the plan step by step."""

from __future__ import annotations

import pytest
from packing_helpers import placeholder_row, random_examples, rank_batches

from megatron_packing.collate import PackedBatch
from megatron_packing.megatron.megatron_lm import (
    ConsumedExamples,
    PackedStepIterator,
    sync_num_microbatches,
)

DP = 2


@pytest.fixture
def calculator():
    from megatron.core import num_microbatches_calculator as calc

    calc.destroy_num_microbatches_calculator()
    calc.init_num_microbatches_calculator(0, None, 8, 1, DP)
    yield calc
    calc.destroy_num_microbatches_calculator()


def _steps():
    batches = []
    for step, size in enumerate((6, 11, 2, 9)):
        examples = random_examples(size, vocab=50, min_len=4, max_len=30, seed=step)
        packed, _ = rank_batches(step, examples, rank=0, dp=DP, capacity=40)
        batches.append(packed)
    return batches


def test_calculator_reports_each_steps_micro_batches(calculator):
    steps = _steps()
    counts = [len(b.micro_batches) for b in steps]
    assert len(set(counts)) > 1, "the steps must vary for this test to mean anything"
    for batch in steps:
        assert sync_num_microbatches(batch.meta, dp_size=DP) == len(batch.micro_batches)
        assert calculator.get_num_microbatches() == len(batch.micro_batches)


def test_iterator_keeps_calculator_one_step_ahead(calculator):
    steps = _steps()
    counter = ConsumedExamples()
    it = PackedStepIterator(steps, dp_size=DP, counter=counter)
    for batch in steps:
        # What Megatron-LM's loop does: read the count, then pull that many micro-batches.
        n = calculator.get_num_microbatches()
        assert n == len(batch.micro_batches)
        pulled = [next(it) for _ in range(n)]
        assert [p["micro_batch"] for p in pulled] == batch.micro_batches
    with pytest.raises(StopIteration):
        next(it)
    assert counter.examples == sum(b.meta.num_examples for b in steps)
    assert counter.steps == len(steps)
    # Rows are not examples: Megatron-LM's own row count would differ.
    assert counter.examples != sum(b.meta.num_bins for b in steps)


def test_placeholder_rows_are_not_examples(calculator):
    batch = _steps()[2]
    tail = PackedBatch(batch.micro_batches + [placeholder_row()], batch.meta)
    tail.meta.num_bins += DP
    tail.meta.micro_batches_per_rank += 1
    counter = ConsumedExamples()
    it = PackedStepIterator([tail], dp_size=DP, counter=counter)
    assert calculator.get_num_microbatches() == len(tail.micro_batches)
    items = list(it)
    assert items[-1]["is_placeholder"] and float(items[-1]["loss_mask"].sum()) == 0.0
    assert counter.examples == batch.meta.num_examples
