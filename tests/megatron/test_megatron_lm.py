"""megatron-core glue: the num-microbatches calculator follows the plan; examples, not rows."""

from __future__ import annotations

import pytest
from packing_helpers import placeholder_row, random_examples, rank_batches

from megatron_packing.megatron.step_accounting import ConsumedExamples, sync_num_microbatches
from megatron_packing.packed.collate import PackedBatch

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


def test_calculator_refuses_a_count_that_does_not_divide_by_dp(calculator):
    batch = _steps()[0]
    batch.meta.num_bins += 1
    with pytest.raises(ValueError, match="do not divide by dp=2"):
        sync_num_microbatches(batch.meta, dp_size=DP)


def test_consumed_examples_count_examples_not_rows_or_placeholders():
    steps = _steps()
    tail = steps[2]
    tail = PackedBatch(tail.micro_batches + [placeholder_row()], tail.meta)
    tail.meta.num_bins += DP
    counter = ConsumedExamples()
    for batch in [*steps[:2], tail, steps[3]]:
        counter.update(batch.meta)
    assert counter.examples == sum(b.meta.num_examples for b in steps)
    assert counter.examples != sum(b.meta.num_bins for b in steps)
    assert counter.steps == len(steps)
    restored = ConsumedExamples()
    restored.load_state_dict(counter.state_dict())
    assert restored == counter
