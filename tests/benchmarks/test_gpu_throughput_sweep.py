"""The megatron-core throughput sweep (`benchmarks/bench_gpu_throughput.py`): its --tiny CPU form
prints a table whose rows agree with the padded sampler's own split, its mask keeps padding away
from real tokens, and without a GPU its plain form says so and exits 0."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_packing.padded.sampler import split_rank_share

PROJECT = Path(__file__).resolve().parents[2]
SCRIPT = PROJECT / "benchmarks" / "bench_gpu_throughput.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_gpu_throughput", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load_script()


def _table(stdout: str) -> dict[str, dict[str, str]]:
    lines = [line for line in stdout.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[1:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells, strict=True))
    return rows


def _number(text: str) -> float:
    return float(text.replace(",", "").rstrip("x"))


@pytest.fixture(scope="module")
def tiny_run() -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), "--tiny"], capture_output=True,
                          text=True, timeout=300, cwd=PROJECT)


@pytest.mark.slow
def test_tiny_sweep_prints_one_sane_row_per_setting(tiny_run):
    assert tiny_run.returncode == 0, tiny_run.stderr[-3000:]
    rows = _table(tiny_run.stdout)
    workload = bench.TINY
    labels = ["mbs 1", "mbs 2"] + [f"budget {b}" for b in workload.budgets]
    assert list(rows) == labels
    assert "GPTModel (local spec, RoPE, float32)" in tiny_run.stdout
    lengths = bench.draw_lengths(workload, 0)
    counts = {}
    for setting in bench.settings(workload):
        row = rows[setting.label]
        # The printed schedule is the padded sampler's own split of the same lengths.
        schedule = split_rank_share(lengths, setting.budget, setting.micro_batch_size)
        padded = sum(len(g) * int(lengths[g].max()) for g in schedule)
        counts[setting.label] = int(row["micro-batches"])
        assert counts[setting.label] == len(schedule)
        efficiency = _number(row["pad eff."])
        assert 0 < efficiency <= 1
        assert efficiency == pytest.approx(int(lengths.sum()) / padded, abs=5e-4)
        for column in ("fwd tok/s median", "fwd tok/s slowest", "fwd+bwd tok/s median",
                       "fwd+bwd tok/s slowest", "fwd+bwd s/pass", "fwd+bwd vs mbs 1",
                       "peak RSS GiB"):
            assert _number(row[column]) > 0, (setting.label, column, row[column])
        assert _number(row["fwd tok/s slowest"]) <= _number(row["fwd tok/s median"])
        seconds = int(lengths.sum()) / _number(row["fwd+bwd tok/s median"])
        assert _number(row["fwd+bwd s/pass"]) == pytest.approx(seconds, rel=0.01, abs=1e-3)
        assert row["GPU util %"] == "n/a"  # CPU
        assert row["note"] == ""
    assert _number(rows["mbs 1"]["pad eff."]) == 1.0
    assert rows["mbs 1"]["fwd+bwd vs mbs 1"] == "1.00x"
    assert counts["mbs 1"] == workload.examples
    assert all(counts[label] <= counts["mbs 1"] for label in labels)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the sweep runs")
def test_without_a_gpu_the_full_form_says_so_and_exits_0():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=120, cwd=PROJECT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == bench.NO_GPU_MESSAGE
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_bad_time_limit_is_refused_by_name():
    done = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--time-limit-s", "0"],
                          capture_output=True, text=True, timeout=120, cwd=PROJECT)
    assert done.returncode == 2
    assert "--time-limit-s must be > 0" in done.stderr
    assert "Traceback" not in done.stderr


# --------------------------------------------------------------------------- the micro-batches
@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=24),
       st.sampled_from([(None, 1), (None, 2), (64, 1), (300, 1), (1024, 1)]))
def test_microbatches_hold_every_example_once_as_padded_blocks(lengths, split):
    budget, micro_batch_size = split
    lengths = np.asarray(lengths, dtype=np.int64)
    setting = bench.Setting("s", budget, micro_batch_size)
    mbs = bench.make_microbatches(lengths, setting, vocab=50, seed=3)
    indices = [i for mb in mbs for i in mb.example_indices]
    assert sorted(indices) == list(range(len(lengths)))
    assert len(mbs) == len(split_rank_share(lengths, budget, micro_batch_size))
    for mb in mbs:
        width = int(lengths[list(mb.example_indices)].max())
        assert mb.tokens.shape == (len(mb.example_indices), width)
        assert mb.lengths.tolist() == lengths[list(mb.example_indices)].tolist()
        if budget is not None and len(mb.example_indices) > 1:
            assert mb.padded_tokens <= budget
    assert sum(mb.num_tokens for mb in mbs) == int(lengths.sum())


# --------------------------------------------------------------------------- the mask
def test_mask_worked_example():
    mask = bench.padded_causal_mask(torch.tensor([3, 1]), 3, "cpu")
    assert mask.shape == (2, 1, 3, 3)
    allowed = (~mask[:, 0]).int().tolist()
    assert allowed[0] == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]  # a full row: causal only
    assert allowed[1] == [[1, 0, 0], [1, 0, 0], [1, 0, 0]]  # one real token: padding hidden


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=5), st.integers(0, 4))
def test_mask_lets_real_queries_see_exactly_their_past(lengths, extra):
    width = max(lengths) + extra
    mask = bench.padded_causal_mask(torch.tensor(lengths), width, "cpu")
    for row, length in enumerate(lengths):
        allowed = ~mask[row, 0]
        for query in range(width):
            keys = allowed[query].nonzero().flatten().tolist()
            # Every query sees keys 0..min(query, length - 1): never a later or a padded key.
            assert keys == list(range(min(query, length - 1) + 1))


_ALONE_VS_PADDED = """
import sys, torch
sys.path.insert(0, {bench_dir!r})
import bench_gpu_throughput as b
torch.set_num_threads(1)
b.start_megatron(False, 0)
runtime = b.Runtime(torch.device("cpu"), False, False, torch.float32)
model = b.build_gpt(b.TINY, runtime, 0).eval()
lengths = [37, 5, 20]
examples = [{{"input_ids": torch.randint(1, b.TINY.vocab, (n,)).numpy(),
             "loss_mask": [1.0] * n}} for n in lengths]
from megatron_packing.padded.collate import collate_microbatch
def loss(mb):
    with torch.no_grad():
        return model(**b.model_inputs(b.to_device(mb, "cpu"), True))
together = loss(collate_microbatch(examples, [0, 1, 2]))
worst = 0.0
for row, n in enumerate(lengths):
    alone = loss(collate_microbatch([examples[row]], [row]))[0, :n - 1]
    worst = max(worst, float(((together[row, :n - 1] - alone).abs() / alone.abs()).max()))
print("worst", worst)
"""


@pytest.mark.slow
def test_padding_never_changes_a_real_tokens_loss():
    """Each example's per-token loss in a padded [3, 37] block equals the example run alone."""
    code = _ALONE_VS_PADDED.format(bench_dir=str(SCRIPT.parent))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=PROJECT)
    assert done.returncode == 0, done.stderr[-3000:]
    worst = float(done.stdout.split("worst")[-1])
    assert np.isfinite(worst) and worst <= 1e-5
