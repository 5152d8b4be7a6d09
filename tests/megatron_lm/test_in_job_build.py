"""A length index built inside the job, longer than the process group's timeout.

Every rank loads the data itself: the rank that takes the cache entry's file lock builds it
while the other waits on that lock, not in a collective, so a build longer than
``--distributed-timeout-minutes 1`` does not time the job out. The data is a real build that
takes over a minute here (`write_slow_build_data`); the waiting rank's progress lines show how
long it waited, and the test requires that wait to exceed the timeout.
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


def test_a_build_longer_than_the_collective_timeout_does_not_time_the_job_out(tmp_path):
    if SKIP_REASON is not None:
        pytest.skip(SKIP_REASON)
    data, records = write_slow_build_data(tmp_path / "data")
    yaml = write_sft_yaml(tmp_path / "sft.yaml", data, tokenizer=data / "tokenizer")
    run = launch(2, ["--packing-config", str(yaml), "--global-batch-size", "16",
                     "--train-iters", str(ITERS), "--distributed-timeout-minutes", "1"],
                 tmp_path / "log", timeout=900)
    assert "Timed out" not in run.output, run.output[-4000:]
    assert run.returncode == 0, run.output[-4000:]
    progress = [int(s) for s in re.findall(
        r"still waiting for the length index of \S+train\.jsonl: lock \S+\.lock, held by pid "
        r"\d+ on host \S+ \(rank \d\), (\d+) s so far", run.output)]
    assert progress[:2] == [30, 60], f"no progress every 30 s:\n{run.output[-4000:]}"
    waited = re.findall(r"the length index of \S+train\.jsonl is built \((\d+) s waited\)",
                        run.output)
    assert len(waited) == 1, run.output[-4000:]
    assert int(waited[0]) > TIMEOUT_S, (
        f"the build took only about {waited[0]} s here, not over the {TIMEOUT_S} s timeout "
        f"this test is about ({records} records, sized from this machine's build rate)")
    assert run.output.count("building the length index of") == 2  # train and valid, once each
    for rank in (0, 1):
        assert [s["iteration"] for s in run.steps(rank)] == list(range(1, ITERS + 1))
