"""A length index built inside the job, longer than the process group's timeout.

Every rank loads the data itself, and the ranks build a missing cache entry together: each
tokenizes parts of it, one merges them, and a rank waits only on file locks, never in a
collective, so a build longer than ``--distributed-timeout-minutes 1`` does not time the job
out. The data is a real build that takes over a minute here with both ranks working
(`write_slow_build_data`); the ranks' summaries show the parts they tokenized and how long the
build took, and the test requires that to exceed the timeout.
"""

from __future__ import annotations

import re

import pytest
from megatron_lm_runs import (
    SKIP_REASON,
    launch,
    requires_megatron_lm,
    write_sft_yaml,
    write_slow_build_data,
)

pytestmark = [requires_megatron_lm, pytest.mark.slow]

TIMEOUT_S = 60
ITERS = 3


BUILT = re.compile(r"\[rank (\d)\]: the length index of \S+/train\.jsonl is built \((\d+) of "
                   r"(\d+) parts tokenized here, (merged here|another process merged it), "
                   r"(\d+) s\)")


def test_a_build_longer_than_the_collective_timeout_does_not_time_the_job_out(tmp_path):
    if SKIP_REASON is not None:
        pytest.skip(SKIP_REASON)
    data, records = write_slow_build_data(tmp_path / "data", sharers=2)
    yaml = write_sft_yaml(tmp_path / "sft.yaml", data, tokenizer=data / "tokenizer")
    run = launch(2, ["--packing-config", str(yaml), "--global-batch-size", "16",
                     "--train-iters", str(ITERS), "--distributed-timeout-minutes", "1"],
                 tmp_path / "log", timeout=900)
    assert "Timed out" not in run.output, run.output[-4000:]
    assert run.returncode == 0, run.output[-4000:]
    built = sorted(BUILT.findall(run.output))
    assert [rank for rank, *_ in built] == ["0", "1"], run.output[-4000:]
    here = [int(h) for _, h, *_ in built]
    (parts,) = {int(n) for _, _, n, *_ in built}
    assert sum(here) == parts and min(here) > 0, f"the ranks did not share the parts: {built}"
    assert sorted(m for *_, m, _ in built) == ["another process merged it", "merged here"]
    seconds = max(int(s) for *_, s in built)
    assert seconds > TIMEOUT_S, (
        f"the build took only about {seconds} s here, not over the {TIMEOUT_S} s timeout "
        f"this test is about ({records} records, sized from this machine's build rate)")
    for rank in (0, 1):
        assert [s["iteration"] for s in run.steps(rank)] == list(range(1, ITERS + 1))
