"""The examples a run trains, as the LR schedule is sized to them, against the real sampler."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from megatron_lm_runs import DP, B, launch, requires_megatron_lm, write_sft_yaml
from torch.utils.data import SequentialSampler

from megatron_packing.megatron.step_accounting import examples_the_run_trains
from megatron_packing.megatron_lm.schedule import schedule_in_examples
from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler

MIN_LR = 3e-4  # tests/megatron_lm/megatron_lm_runs.py's MODEL_ARGS


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(8, 120), batch=st.integers(4, 24), dp=st.integers(1, 4),
       iters=st.integers(1, 40), seed=st.integers(0, 3))
def test_the_count_is_what_the_sampler_emits_over_any_number_of_epochs(n, batch, dp, iters,
                                                                        seed):
    lengths = np.random.default_rng(seed).integers(1, 200, n).tolist()
    sampler = DPAlignedPackingBatchSampler(SequentialSampler(range(n)), lengths, batch, dp,
                                           bin_capacity=256, allowed_variation=0.3,
                                           total_steps=iters)
    emitted, steps = 0, 0
    while steps < iters:
        for planned in sampler:
            emitted += planned.plan.num_examples
            steps += 1
    assert emitted == examples_the_run_trains(iters, len(sampler), n, batch)


def test_worked_examples():
    assert examples_the_run_trains(8, 38, 600, 16) == 128  # inside the first epoch: iters x B
    assert examples_the_run_trains(3, 3, 40, 16) == 40  # one whole epoch, short last step
    assert examples_the_run_trains(7, 3, 40, 16) == 2 * 40 + 16


def _args(**values):
    base = dict(global_batch_size=16, train_iters=7, lr_decay_iters=None, train_samples=None,
                lr_decay_samples=None, lr_warmup_samples=0, lr_warmup_iters=2,
                lr_wsd_decay_iters=None, lr_wsd_decay_samples=None)
    return SimpleNamespace(**{**base, **values})


def test_megatron_sizes_the_schedule_in_examples_only_while_it_builds_it():
    args = _args()
    with schedule_in_examples(args, 96) as resized:
        assert resized
        assert (args.train_iters, args.train_samples, args.lr_decay_samples,
                args.lr_warmup_samples) == (None, 96, 96, 32)
    assert (args.train_iters, args.train_samples, args.lr_decay_samples) == (7, None, None)
    for exact in (_args(train_iters=6), _args(lr_decay_iters=5)):
        with schedule_in_examples(exact, 96) as resized:
            assert not resized and exact.train_samples is None


@requires_megatron_lm
@pytest.mark.slow
def test_a_multi_epoch_run_ends_exactly_at_min_lr(sft_data, tmp_path):
    """40 examples, B = 16: three steps an epoch (the last one short); 7 iterations cross two
    epochs and train 2 x 40 + 16 examples, and the LR reaches --min-lr on the last one."""
    data = tmp_path / "data"
    data.mkdir()
    chats = (sft_data / "train.jsonl").read_text().splitlines()[:40]
    (data / "train.jsonl").write_text("\n".join(chats) + "\n")
    (data / "valid.jsonl").write_text((sft_data / "valid.jsonl").read_text())
    yaml = write_sft_yaml(tmp_path / "sft.yaml", data)
    tb = tmp_path / "tb"
    run = launch(DP, ["--packing-config", str(yaml), "--global-batch-size", str(B),
                      "--train-iters", "7", "--tensorboard-dir", str(tb), "--eval-iters", "1"],
                 tmp_path / "log")
    assert run.returncode == 0, run.output[-4000:]
    steps = run.steps(0)
    assert {s["epoch"] for s in steps} == {0, 1, 2}
    assert steps[-1]["consumed_train_samples"] == 2 * 40 + 16
    assert "the run trains 96 examples over 7 iterations" in run.output
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb))
    events.Reload()
    final_lr = {e.step: e.value for e in events.Scalars("learning-rate")}[7]
    assert final_lr == pytest.approx(MIN_LR, rel=1e-6)
