"""Cross-rank agreement over real gloo process groups (spawned processes, no mocks)."""

from __future__ import annotations

import json
import os
import time
from collections import deque
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_packing.padded.sync import TokenBudgetController, align_microbatch_count

pytestmark = pytest.mark.slow
TIMEOUT_S = 90


def _init(rank: int, world: int, store: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def _run(fn, world: int, *args) -> None:
    """Spawn ``world`` ranks; fail (not hang) if they do not finish in time."""
    context = mp.start_processes(fn, args=(world, *args), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            pytest.fail(f"ranks did not finish within {TIMEOUT_S} s (deadlock?)")


# --------------------------------------------------------------------------- align count
def _align_worker(rank: int, world: int, store: str, out: str) -> None:
    _init(rank, world, store)
    counts = [3, 1, 5, 0][:world]
    schedule = [[rank, m] for m in range(counts[rank])]
    aligned = align_microbatch_count(schedule)
    result = {"all": aligned}
    if world == 4:  # two independent pairs: {0, 1} and {2, 3}
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        result["pair"] = align_microbatch_count(schedule, group=pairs[rank // 2])
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_align_microbatch_count_over_gloo(tmp_path, world):
    _run(_align_worker, world, str(tmp_path / "store"), str(tmp_path))
    counts = [3, 1, 5, 0][:world]
    for rank in range(world):
        result = json.loads((tmp_path / f"{rank}.json").read_text())
        aligned = result["all"]
        assert len(aligned) == max(counts)
        assert aligned[: counts[rank]] == [[rank, m] for m in range(counts[rank])]
        assert aligned[counts[rank]:] == [None] * (max(counts) - counts[rank])
        if world == 4:
            pair_max = max(counts[(rank // 2) * 2:(rank // 2) * 2 + 2])
            assert len(result["pair"]) == pair_max


def test_align_without_process_group_is_a_copy():
    schedule = [[1], [2]]
    aligned = align_microbatch_count(schedule)
    assert aligned == schedule and aligned is not schedule


# --------------------------------------------------------------------------- runtime budget
STEPS = 30


def _budget_worker(rank: int, world: int, store: str, out: str, written_ns: int) -> None:
    import numpy as np

    from megatron_packing.padded.sampler import TokenBudgetBatchSampler
    from megatron_packing.stream.base_order import SeededRandomOrder

    _init(rank, world, store)
    lengths = np.random.default_rng(0).integers(16, 2048, size=2000)
    sampler = TokenBudgetBatchSampler(
        SeededRandomOrder(len(lengths), seed=5), lengths, 32, world, dp_rank=rank,
        max_tokens_per_microbatch=8192,
    )
    # Each rank has its own view of the control file, updated at a different step (a shared
    # file system that shows the change late on some hosts).
    view = Path(out, f"view{rank}.json")
    controller = TokenBudgetController(8192, control_file=view, check_every=3, target=sampler)
    plans = iter(sampler)
    ahead: deque = deque()
    lookahead = rank + 1  # ranks plan different numbers of steps ahead, like loader prefetch
    record = []
    for step in range(STEPS):
        if step == 4 + 5 * rank:
            view.write_text(json.dumps({"max_tokens_per_microbatch": 2048}))
            os.utime(view, ns=(written_ns, written_ns))  # one write, seen late by some ranks
        if step == 13 and rank == world - 1:
            controller.request(16384, from_step=20)  # the API call, made on one rank only
        if step == 22 and rank == 0:
            view.write_text("max_tokens_per_microbatch: -3\n")  # a bad edit: ignored, no hang
        controller.step_boundary(step)
        while len(ahead) < lookahead:
            ahead.append(next(plans))
        plan = ahead.popleft()
        assert plan.step == step
        record.append([plan.max_tokens, plan.microbatches_per_rank, len(plan)])
        time.sleep(0.01 * rank)  # ranks run at different speeds
    Path(out, f"{rank}.json").write_text(json.dumps({"record": record, "changes": controller.changes}))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2])
def test_budget_change_applies_at_the_same_step_on_every_rank(tmp_path, world):
    _run(_budget_worker, world, str(tmp_path / "store"), str(tmp_path), time.time_ns())
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]
    budgets = [[row[0] for row in result["record"]] for result in results]
    counts = [[row[1] for row in result["record"]] for result in results]
    assert all(b == budgets[0] for b in budgets), budgets
    assert all(c == counts[0] for c in counts)  # equal micro-batch counts every step
    assert all(result["changes"] == results[0]["changes"] for result in results)
    first_small = budgets[0].index(2048)
    # rank 0 saw the file at step 4 and the check at step 6 agrees on it; by then rank r has
    # planned up to step 6 + r - 1, so the switch lands on the first step nobody has planned.
    assert first_small == 6 + world - 1
    assert set(budgets[0][:first_small]) == {8192}
    assert budgets[0][20:] == [16384] * (STEPS - 20)
    assert set(budgets[0][first_small:20]) == {2048}
