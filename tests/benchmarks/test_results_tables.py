"""The benchmark tables in README.md and docs/benchmarks.md are the saved results files."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[2]
SCRIPT = PROJECT / "benchmarks" / "results_tables.py"


def _module():
    spec = importlib.util.spec_from_file_location("results_tables", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_include_in_the_docs_is_its_results_file():
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True,
                          text=True, cwd=PROJECT)
    assert done.returncode == 0, done.stderr
    readme = (PROJECT / "README.md").read_text()
    assert "<!-- results: bench_dp_balanced.md -->" in readme
    assert "| dp_balanced (Megatron-LM) |" in readme


def test_a_stale_include_is_found_and_a_missing_file_named():
    tables = _module()
    text = "<!-- results: bench_packers.md -->\nan old table\n<!-- /results -->\n"
    filled = tables.rendered(text)
    assert "an old table" not in filled
    assert (PROJECT / "benchmarks" / "results" / "bench_packers.md").read_text().strip() in filled
    assert tables.rendered(filled) == filled
    try:
        tables.rendered("<!-- results: bench_none.md -->\n<!-- /results -->")
    except FileNotFoundError as error:
        assert "bench_none.md" in str(error)
    else:
        raise AssertionError("a missing results file was not named")
