"""A run continued on another number of ranks through Megatron-LM's ``--load`` (CPU, gloo).

One chain over a 96-example epoch (B = 16: 6 steps an epoch, 9 iterations in all): DP 2 trains
to its iteration-3 checkpoint and stops (``--exit-interval``), DP 4 loads it and trains to 6,
DP 2 loads that and trains past the epoch's end to 9. A branch loads the iteration-3
checkpoint at the same world size with TP 2 (DP 1), through torch_dist. Each resumed run's steps
must be exactly those a fresh sampler at the new size plans from the saved global state, and the
epoch's examples must be trained exactly once across the launches.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from megatron_lm_runs import PROJECT, launch, requires_megatron_lm, write_sft_yaml

from megatron_packing.config import PackingConfig
from megatron_packing.config.data_loading import load_data_split
from megatron_packing.config.training import DataConfig
from megatron_packing.megatron.step_accounting import examples_the_run_trains
from megatron_packing.packed.components import build_packing_sampler

pytestmark = [requires_megatron_lm, pytest.mark.slow, pytest.mark.one_stack(
    "the plan at another size is the library's; megatron-core 0.19's torch_dist resharding to "
    "another TP / PP layout runs on the second stack in "
    "tests/bridge/test_bridge_host.py::test_pp3_resumes_a_tp2_checkpoint_with_its_losses")]

N, B, ITERS, EVERY = 96, 16, 9, 3
WARMUP, LR, MIN_LR = 2, 3e-3, 3e-4
SEQ = 256  # MODEL_ARGS' --seq-length: the packing capacity the entry point resolves


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("elastic_data")
    chats = (PROJECT / "examples" / "data" / "demo_chat.jsonl").read_text().splitlines()
    (out / "train.jsonl").write_text("\n".join(chats[:N]) + "\n")
    (out / "valid.jsonl").write_text("\n".join(chats[N:N + 16]) + "\n")
    return out


def _args(yaml, save, *extra):
    return ["--packing-config", str(yaml), "--global-batch-size", str(B), "--train-iters",
            str(ITERS), "--save", str(save), "--save-interval", str(EVERY), "--eval-iters", "0",
            *extra]


@pytest.fixture(scope="module")
def chain(small_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("elastic")
    yaml = write_sft_yaml(tmp / "sft.yaml", small_data)
    save = tmp / "ckpt"
    runs = [launch(2, _args(yaml, save, "--exit-interval", "3"), tmp / "log_dp2")]
    assert runs[0].returncode == 0, runs[0].output[-4000:]
    runs.append(launch(4, _args(yaml, save, "--load", str(save), "--exit-interval", "6"),
                       tmp / "log_dp4"))
    assert runs[1].returncode == 0, runs[1].output[-4000:]
    runs.append(launch(2, _args(yaml, save, "--load", str(save)), tmp / "log_dp2_again"))
    assert runs[2].returncode == 0, runs[2].output[-4000:]
    return tmp, yaml, save, runs


def _global_steps(run, dp):
    """Per iteration: the examples of each DP rank (from the ranks with TP / PP rank 0)."""
    out = {}
    for records in run.records.values():
        for step in records:
            if "examples" in step and step.get("tp", 0) == 0:
                ranks = out.setdefault(step["iteration"], [None] * dp)
                ranks[step["dp"]] = [e for row in step["examples"] for e in row]
    return out


def _fresh_plans(small_data, yaml, state_path, dp):
    """The plans a fresh global sampler at size ``dp`` makes from a saved loader state."""
    saved = torch.load(state_path, map_location="cpu", weights_only=False)
    part = saved["dataloader_state_dict"]["global"]["loader"]
    data = DataConfig(paths=[str(small_data / "train.jsonl")],
                      tokenizer=str(PROJECT / "examples" / "tokenizer"),
                      cache_dir=str(small_data / "cache"))
    dataset = load_data_split(data, data.paths)
    config = PackingConfig(global_batch_size=B, bin_capacity=SEQ, seed=1234,
                           align_packing_bins_to_dp=True,
                           packing_batch_size_allowed_variation=0.2, oversize_policy="truncate")
    sampler = build_packing_sampler(dataset, config, dp_rank=None, dp_size=dp, seed=1234,
                                    total_steps=ITERS)
    sampler.load_state_dict(part["sampler"])  # refuses any setting the run did not use
    plans = []
    for _ in range(2):  # to the end of the run, across the epoch boundary
        plans += [batch.plan for batch in sampler]
    return part, plans


def _state_file(save, iteration, dp_rank=0):
    return next(save.glob(f"iter_{iteration:07d}/mp_rank_*/train_dataloader_dprank"
                          f"{dp_rank:03d}.pt"))


def _megatron_lr(consumed: int) -> float:
    """Linear warmup, then cosine decay, sized in the run's real examples."""
    total = examples_the_run_trains(ITERS, math.ceil(N / B), N, B)
    warmup = WARMUP * B
    if consumed <= warmup:
        return LR * consumed / warmup
    ratio = (consumed - warmup) / (total - warmup)
    return MIN_LR + (LR - MIN_LR) * 0.5 * (math.cos(math.pi * ratio) + 1)


def test_the_epoch_is_trained_exactly_once_across_dp_2_4_2(chain):
    _, _, _, runs = chain
    steps = {**_global_steps(runs[0], 2), **_global_steps(runs[1], 4),
             **_global_steps(runs[2], 2)}
    assert sorted(steps) == list(range(1, ITERS + 1))
    assert all(None not in steps[i] for i in steps)
    first_epoch = [e for i in range(1, 7) for rank in steps[i] for e in rank]
    assert sorted(first_epoch) == list(range(N))
    second = [e for i in range(7, ITERS + 1) for rank in steps[i] for e in rank]
    assert len(second) == len(set(second))
    assert [len(steps[i]) for i in (3, 4, 6, 7)] == [2, 4, 4, 2]
    assert "saved at data-parallel size 2, now 4" in runs[1].output
    assert "saved at data-parallel size 4, now 2" in runs[2].output


@pytest.mark.parametrize(("launch_index", "iteration", "dp"), [(1, 3, 4), (2, 6, 2)])
def test_resumed_steps_are_the_plan_of_a_fresh_sampler_at_the_new_size(
        chain, small_data, launch_index, iteration, dp):
    _, yaml, save, runs = chain
    part, plans = _fresh_plans(small_data, yaml, _state_file(save, iteration), dp)
    assert part["dp_size"] == {4: 2, 2: 4}[dp]
    got = _global_steps(runs[launch_index], dp)
    for plan in plans[:len(got)]:
        assert got[plan.step + 1] == [plan.examples_of_rank(r) for r in range(dp)]
    records = runs[launch_index].steps(0)
    assert [r["num_examples"] for r in records] == [p.num_examples for p in plans[:len(records)]]


def test_consumed_samples_and_the_lr_continue_in_real_examples(chain):
    _, _, _, runs = chain
    records = [r for run in runs for r in run.steps(0)]
    consumed = 0
    for record in records:  # the LR a step trains with is the schedule's before it advances
        assert record["lr"] == pytest.approx(_megatron_lr(consumed), rel=1e-9, abs=1e-12)
        consumed += record["num_examples"]
        assert record["consumed_train_samples"] == consumed
    assert consumed == examples_the_run_trains(ITERS, math.ceil(N / B), N, B)


def test_tp_1_to_2_at_the_same_world_size_through_torch_dist(chain, small_data, tmp_path):
    tmp, yaml, save, _ = chain
    branch = tmp_path / "ckpt"
    shutil.copytree(save / "iter_0000003", branch / "iter_0000003")
    (branch / "latest_checkpointed_iteration.txt").write_text("3")
    run = launch(2, _args(yaml, branch, "--load", str(branch), "--exit-interval", "5",
                          "--tensor-model-parallel-size", "2"), tmp_path / "log")
    assert run.returncode == 0, run.output[-4000:]
    assert "in torch_dist format" in run.output
    _, plans = _fresh_plans(small_data, yaml, _state_file(save, 3), 1)
    got = _global_steps(run, 1)
    assert sorted(got) == [4, 5]
    for plan in plans[:2]:
        assert got[plan.step + 1] == [plan.examples_of_rank(0)]
    both = {rank: [r["examples"] for r in run.steps(rank)] for rank in (0, 1)}
    assert both[0] == both[1]  # the two TP ranks train the same rows
    assert [{r["tp"] for r in run.steps(rank)} for rank in (0, 1)] == [{0}, {1}]
