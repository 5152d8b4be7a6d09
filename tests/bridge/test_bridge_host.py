"""The Bridge host in real launches: a Bridge recipe (`tiny_recipe`) trained by
`megatron_packing.bridge` under torchrun on CPU with gloo, Bridge's ``setup()``, ``train_step``,
checkpoints and exits underneath (the CPU shims are `bridge_shims`)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from bridge_runs import launch, launch_and_kill, requires_bridge, trained_past, write_yaml

pytestmark = [pytest.mark.slow, pytest.mark.bridge, requires_bridge]

B, ITERS = 16, 10
LR, MIN_LR, WARMUP = 1e-3, 1e-4, 2


@pytest.fixture(scope="session")
def bridge_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """600 chats of the shipped demo data."""
    out = tmp_path_factory.mktemp("bridge_data")
    chats = (Path(__file__).resolve().parents[2] / "examples" / "data" / "demo_chat.jsonl"
             ).read_text().splitlines()
    (out / "train.jsonl").write_text("\n".join(chats[:600]) + "\n")
    return out


def reference_args(yaml: Path, save: Path, *extra: str) -> list[str]:
    return ["--packing-config", str(yaml), "--global-batch-size", str(B), "--train-iters",
            str(ITERS), "--cosine", "--save", str(save), "--save-interval", "5",
            "--recipe", "model.hidden_dropout=0.1", "rng.data_parallel_random_init=true", *extra]


@pytest.fixture(scope="session")
def reference(bridge_data, tmp_path_factory):
    """The uninterrupted DP-2 run: 10 iterations, warmup and cosine decay, saves at 5 and 10;
    dropout on, so that an exact resume needs the RNG states of Bridge's checkpoint too."""
    tmp = tmp_path_factory.mktemp("bridge_reference")
    yaml = write_yaml(tmp / "sft.yaml", bridge_data)
    run = launch(2, reference_args(yaml, tmp / "ckpt"), tmp / "log")
    assert run.returncode == 0, run.output[-4000:]
    return run, yaml


def megatron_lr(consumed: int, total: int) -> float:
    """Megatron's warmup + cosine LR after ``consumed`` schedule units (examples here)."""
    warmup = WARMUP * B
    if consumed <= warmup:
        return LR * consumed / warmup
    ratio = (consumed - warmup) / (total - warmup)
    return MIN_LR + 0.5 * (math.cos(math.pi * ratio) + 1) * (LR - MIN_LR)


def test_a_recipe_trains_packed_steps_each_example_once_counted_in_examples(reference):
    run, _ = reference
    steps = run.steps(0)
    assert [s["iteration"] for s in steps] == list(range(1, ITERS + 1))
    counts = [s["micro_batches"] for s in steps]
    assert len(set(counts)) > 1 and any(b < a for a, b in zip(counts, counts[1:], strict=False)), (
        f"the counts {counts} never fall: Bridge's own loop would have run them")
    seen: list[int] = []
    for rank in (0, 1):
        for step in run.steps(rank):
            seen += [i for row in step["examples"] for i in row]
    assert len(seen) == len(set(seen)) == ITERS * B  # no repeat, drift repaid by the last step
    consumed = 0
    for step in steps:
        # the LR this step trained with: the schedule after the examples of the steps before it
        assert step["lr"] == pytest.approx(megatron_lr(consumed, ITERS * B), rel=1e-9, abs=1e-12)
        consumed += step["num_examples"]
        assert step["consumed_train_samples"] == consumed
    assert "global batch size:    " in run.output
    logged = [int(line.split("global batch size:")[1].split("|")[0])
              for line in run.output.splitlines() if "global batch size:" in line]
    assert logged == [s["num_examples"] for s in steps]
    assert all(math.isfinite(s["loss"]) for s in steps) and steps[-1]["loss"] < steps[0]["loss"]


def test_the_flops_count_each_sequence_s_own_attention(reference):
    """Bridge's THD-aware FLOPs term: the sum over sequences of length squared, all DP ranks."""
    run, _ = reference
    for step0, step1 in zip(run.steps(0), run.steps(1), strict=True):
        lengths = [n for step in (step0, step1) for row in step["doc_lengths"] for n in row]
        assert step0["seqlen_sq_sum"] == sum(n * n for n in lengths)
        assert sum(lengths) >= step0["num_tokens"]  # placeholder rows hold padding tokens
        rows = step0["num_bins"]
        assert step0["seqlen_sq_sum"] < rows * 256 ** 2  # far below a dense row's count
        assert step0["flops"] > 0 and step0["flops_so_far"] >= step0["flops"]


def test_killed_after_a_checkpoint_the_host_resumes_as_the_uninterrupted_run(reference, tmp_path):
    run, yaml = reference
    save = tmp_path / "ckpt"
    killed = launch_and_kill(2, reference_args(yaml, save), tmp_path / "log_killed",
                             kill_when=trained_past(tmp_path / "log_killed", 5))
    assert killed.returncode != 0 and len(killed.steps(0)) < ITERS
    resumed = launch(2, reference_args(yaml, save, "--load", str(save)), tmp_path / "log")
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert "restored the packing loader state of iteration 5" in resumed.output
    for rank in (0, 1):
        want = [s for s in run.steps(rank) if s["iteration"] > 5]
        got = resumed.steps(rank)
        assert [s["iteration"] for s in got] == [s["iteration"] for s in want]
        for g, w in zip(got, want, strict=True):
            for key in ("examples", "consumed_train_samples", "lr", "micro_batches", "loss"):
                assert g[key] == w[key], (key, g["iteration"])


def test_pp3_resumes_a_tp2_checkpoint_with_its_losses(bridge_data, tmp_path):
    """The same weights at TP 2 and PP 3 (3 layers): a TP-2 run (DP 1) saves at step 2 and goes
    on to 4; a PP-3 run (DP 1) loads that checkpoint (torch_dist reshards it) and its steps 3
    and 4 repeat the TP-2 run's losses to float32 rounding (3e-5). At PP 3 the middle stage
    attends within each packed sequence only if it gets the row's boundaries too (without them
    the loss moves by about 1e-4)."""
    yaml = write_yaml(tmp_path / "sft.yaml", bridge_data, seed=7)
    common = ["--packing-config", str(yaml), "--global-batch-size", "8", "--train-iters", "4",
              "--recipe", "model.num_layers=3"]
    save = tmp_path / "ckpt"
    tp2 = launch(2, [*common, "--tp", "2", "--save", str(save), "--save-interval", "2"],
                 tmp_path / "log_tp")
    assert tp2.returncode == 0, tp2.output[-4000:]
    want = {s["iteration"]: s["loss"] for s in tp2.steps(0) if s["iteration"] > 2}
    assert {s["tp"] for rank in tp2.records for s in tp2.steps(rank)} == {0, 1}
    pp3 = launch(3, [*common, "checkpoint.ckpt_step=2", "--pp", "3", "--load", str(save)],
                 tmp_path / "log_pp")
    assert pp3.returncode == 0, pp3.output[-4000:]
    last = max(pp3.records)  # the last pipeline stage holds the loss
    got = {s["iteration"]: s["loss"] for s in pp3.steps(last)}
    assert got.keys() == want.keys()
    for iteration, loss in want.items():
        assert got[iteration] == pytest.approx(loss, rel=3e-5), iteration


def test_padded_mode_runs_every_rank_at_the_step_s_largest_count(bridge_data, tmp_path):
    yaml = write_yaml(tmp_path / "sft.yaml", bridge_data, use_sequence_packing=False,
                      max_tokens_per_microbatch=384)
    run = launch(2, ["--packing-config", str(yaml), "--global-batch-size", "16",
                     "--train-iters", "3", "--seq-length", "1536"], tmp_path / "log")
    assert run.returncode == 0, run.output[-4000:]
    seen = []
    for s0, s1 in zip(run.steps(0), run.steps(1), strict=True):
        assert s0["micro_batches"] == s1["micro_batches"]
        seen += [i for step in (s0, s1) for row in step["examples"] for i in row]
    assert len(seen) == len(set(seen)) == 3 * 16
    assert all(math.isfinite(s["loss"]) for s in run.steps(0))


def test_the_documented_llama_recipe_trains_through_the_host(bridge_data, tmp_path):
    """examples/bridge/finetune_llama.py's recipe (a Hugging Face Llama configuration through
    Bridge's AutoBridge, small, random weights), made to run on CPU (`tiny_recipe.on_cpu`)."""
    yaml = write_yaml(tmp_path / "sft.yaml", bridge_data)
    run = launch(2, ["--packing-config", str(yaml), "--global-batch-size", "16",
                     "--train-iters", "4", "--llama"], tmp_path / "log")
    assert run.returncode == 0, run.output[-4000:]
    steps = run.steps(0)
    assert [s["iteration"] for s in steps] == [1, 2, 3, 4]
    assert sum(s["num_examples"] for s in steps) == 4 * 16
    assert all(math.isfinite(s["loss"]) for s in steps) and steps[-1]["loss"] < steps[0]["loss"]
