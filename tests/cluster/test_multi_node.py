"""Two nodes simulated on one host: two torchrun launchers (``--nnodes 2``, ``--node-rank 0``
and ``1``, one process each, one rendezvous on 127.0.0.1) train through the entry point with
one cache directory that both nodes share.

The uninterrupted run trains each example once, and the nodes build each cache entry once
between them (the other node waits on the entry's file lock, or finds it built). A second run
loses node 1 (kill -9 of its launcher and its rank) after the iteration-4 checkpoint; node 0's
rank then fails by itself, and both nodes restarted with ``--load`` continue exactly as the
uninterrupted run.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from megatron_lm_runs import (
    _PORT,
    DP,
    ITERS,
    MODEL_ARGS,
    RUN_CPU,
    B,
    Run,
    _env,
    descendants,
    read_records,
    reference_args,
    requires_megatron_lm,
    same_steps,
    tracker_says,
    write_sft_yaml,
)

pytestmark = [requires_megatron_lm, pytest.mark.slow]

NODES = 2


def start_nodes(args: list[str], log_dir: Path) -> list[subprocess.Popen]:
    """One torchrun launcher per node, each with one rank, meeting at 127.0.0.1."""
    _PORT[0] += 1
    nodes = []
    for node in range(NODES):
        command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}",
                   f"--node-rank={node}", "--nproc-per-node=1", "--master-addr=127.0.0.1",
                   f"--master-port={_PORT[0]}", str(RUN_CPU), *MODEL_ARGS, *args,
                   "--packing-log-dir", str(log_dir)]
        nodes.append(subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    return nodes


def kill_node(node: subprocess.Popen) -> None:
    """What losing the node does: its launcher and its rank die, no process cleans up."""
    for pid in [node.pid, *descendants(node.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def finish(nodes: list[subprocess.Popen], log_dir: Path, timeout: float) -> list[Run]:
    deadline = time.monotonic() + timeout
    runs = []
    try:
        for node in nodes:
            output = node.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
            runs.append(Run(node.returncode, output, log_dir, read_records(log_dir)))
    finally:
        for node in nodes:
            if node.poll() is None:
                kill_node(node)
                node.communicate()
    return runs


def run_nodes(args: list[str], log_dir: Path, *, timeout: float = 400) -> list[Run]:
    runs = finish(start_nodes(args, log_dir), log_dir, timeout)
    for node, run in enumerate(runs):
        assert run.returncode == 0, f"node {node}:\n{run.output[-4000:]}"
    return runs


@pytest.fixture(scope="module")
def two_nodes(sft_data, tmp_path_factory):
    """The uninterrupted run, the run that loses node 1, and its restart with --load."""
    tmp = tmp_path_factory.mktemp("two_nodes")
    yaml = write_sft_yaml(tmp / "sft.yaml", sft_data, cache=tmp / "shared_cache")
    whole = run_nodes(reference_args(yaml, tmp / "ckpt_whole"), tmp / "log_whole")

    save = tmp / "ckpt"
    nodes = start_nodes(reference_args(yaml, save), tmp / "log_killed")
    reached = tracker_says(save, 4)
    deadline = time.monotonic() + 400
    try:
        while not reached(tmp / "log_killed"):
            assert all(node.poll() is None for node in nodes), "a node ended before iteration 4"
            assert time.monotonic() < deadline, "the run never reached its iteration-4 checkpoint"
            time.sleep(0.02)
        kill_node(nodes[1])
    finally:
        killed = finish(nodes, tmp / "log_killed", timeout=240)
    resumed = run_nodes(reference_args(yaml, save, "--load", str(save)), tmp / "log_resumed")
    return whole, killed, resumed


def test_two_nodes_train_each_example_once(two_nodes):
    whole = two_nodes[0][0]
    seen: list[int] = []
    for i in range(ITERS):
        rows = [row for rank in range(DP) for row in whole.steps(rank)[i]["examples"]]
        indices = [e for row in rows for e in row]
        assert len(indices) == whole.steps(0)[i]["num_examples"]
        seen += indices
    assert len(seen) == len(set(seen)) == ITERS * B


BUILT = re.compile(r"the length index of \S+/(train|valid)\.jsonl is built \((\d+) of (\d+) "
                   r"parts tokenized here, (merged here|another process merged it)")


def test_the_nodes_build_each_cache_entry_once_between_them(two_nodes):
    whole, _, resumed = two_nodes
    built = [found for run in whole for found in BUILT.findall(run.output)]
    for name in ("train", "valid"):
        mine = [b for b in built if b[0] == name]
        assert mine, built  # (a rank that came after the merge read the entry, saying nothing)
        (parts,) = {int(b[2]) for b in mine}
        assert sum(int(b[1]) for b in mine) == parts, f"a part of {name} built twice: {mine}"
        assert [b[3] for b in mine].count("merged here") == 1, mine
    assert not any("building the length index of" in run.output for run in resumed)


def test_losing_a_node_after_a_checkpoint_then_load_resumes_exactly(two_nodes):
    whole, killed, resumed = two_nodes
    assert killed[1].returncode == -signal.SIGKILL
    assert killed[0].returncode != 0, "node 0 kept running after node 1 was lost"
    assert "restored the packing loader state of iteration 4" in resumed[0].output
    for rank in range(DP):
        assert [s["iteration"] for s in resumed[0].steps(rank)] == list(range(5, ITERS + 1))
        same_steps(resumed[0].steps(rank), whole[0].steps(rank)[4:])
