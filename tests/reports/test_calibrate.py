"""``megatron-packing calibrate``: the fit of a timings file, bad input, --write, and the timing
harness itself on the CPU (which only tests it: CPU timings do not predict a GPU)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from megatron_packing.cli import main
from megatron_packing.packing.cost_design import design_compositions
from megatron_packing.packing.cost_fit import Measured
from megatron_packing.reports.calibration import CPU_NOTE
from megatron_packing.reports.packing_keys import set_packing_keys
from megatron_packing.reports.timing_harness import LayerShape, time_layer

# a = 2 ms per micro-batch, b = 0.001 ms per token, c = 1e-7 ms per squared length:
# attention_cost_constant = b / c = 10,000 and microbatch_cost_tokens = a / b = 2,000.
A, B, C = 2.0, 0.001, 1e-7


def _line(lengths: list[int], a: float = A, b: float = B, c: float = C) -> str:
    ms = a + b * sum(lengths) + c * sum(s * s for s in lengths)
    return json.dumps({"lengths": lengths, "ms": ms})


def _timings(path, a: float = A, b: float = B, c: float = C):
    path.write_text("".join(_line(d, a, b, c) + "\n" for d in design_compositions(8192)))
    return path


def test_a_timings_file_is_fitted_and_the_two_keys_printed_last(tmp_path, capsys):
    timings = _timings(tmp_path / "timings.jsonl")
    assert main(["calibrate", "--from-timings", str(timings)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2:] == ["attention_cost_constant: 10000", "microbatch_cost_tokens: 2000"]
    rows = [line for line in out if line.startswith("| ") and not line.startswith("| composition")]
    assert len(rows) == len(design_compositions(8192))
    # 2 + 0.001 x 8,192 + 1e-7 x 8,192^2 = 16.903 ms, modeled exactly.
    assert "| 1 x 8192 | 1 | 8,192 | 67,108,864 | 16.903 | 16.903 | +0.0% |" in out
    assert any(line.startswith("fit: ms = a + b x tokens + c x sum(s^2), a = 2 ms per micro-batch")
               for line in out)


@pytest.mark.parametrize("text,message", [
    ("", "the timings file is empty"),
    ("\n\n", "the timings file is empty"),
    ('{"lengths": [4], "ms": 1.0}\nnot json\n', "line 2: not a JSON line"),
    ('[1, 2]\n', "line 1: expected an object"),
    ('{"lengths": [], "ms": 1.0}\n', "line 1: lengths must be a non-empty list"),
    ('{"lengths": [4, 0], "ms": 1.0}\n', "line 1: lengths must be integers >= 1, got 0"),
    ('{"lengths": [4, -3], "ms": 1.0}\n', "line 1: lengths must be integers >= 1, got -3"),
    ('{"lengths": [4.5], "ms": 1.0}\n', "line 1: lengths must be integers >= 1, got 4.5"),
    ('{"lengths": [4], "ms": 0}\n', "line 1: ms must be a number > 0"),
    ('{"lengths": [4], "ms": -2.5}\n', "line 1: ms must be a number > 0"),
    ('{"lengths": [4]}\n', "line 1: missing 'ms'"),
    ('{"lengths": [4], "ms": 1, "note": 1}\n', "line 1: unknown key 'note'"),
    ('{"lengths": [64], "ms": 1}\n{"lengths": [32, 32], "ms": 1.1}\n{"lengths": [64], "ms": 1.2}\n',
     "lines 1-3: too few distinct compositions to fit three constants: 3 lines, 2 distinct"),
])
def test_a_bad_timings_file_is_one_line_naming_the_file_and_the_line(tmp_path, capsys, text,
                                                                     message):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    assert main(["calibrate", "--from-timings", str(path)]) == 2
    printed = capsys.readouterr()
    assert printed.out == ""
    lines = printed.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in printed.err
    assert lines[0].startswith(f"megatron-packing calibrate: error: {path}")
    assert message in lines[0]


def test_a_missing_timings_file_is_named(tmp_path, capsys):
    assert main(["calibrate", "--from-timings", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl: no such timings file" in capsys.readouterr().err


def test_a_negative_fit_shows_the_table_and_writes_no_key(tmp_path, capsys):
    # Timings with a negative per-micro-batch cost: longer rows cheaper than the model allows.
    timings = _timings(tmp_path / "t.jsonl", a=-0.5)
    config = tmp_path / "sft.yaml"
    config.write_text("packing:\n  global_batch_size: 64\n")
    before = config.read_text()
    assert main(["calibrate", "--from-timings", str(timings), "--config", str(config),
                 "--write"]) == 2
    printed = capsys.readouterr()
    assert "| 1 x 8192 | 1 |" in printed.out
    assert "attention_cost_constant:" not in printed.out
    assert printed.err.startswith("megatron-packing calibrate: error: the fit's constants come "
                                  "out negative (a = -0.5 ms per micro-batch)")
    assert "no key is given and none written" in printed.err
    assert config.read_text() == before


def test_write_sets_both_keys_and_keeps_the_rest_of_the_file(tmp_path, capsys):
    timings = _timings(tmp_path / "t.jsonl")
    config = tmp_path / "sft.yaml"
    config.write_text("# my run\npacking:\n  global_batch_size: 64   # B\n"
                      "  attention_cost_constant: 24576  # the old k\n\n"
                      "data:\n  paths: [a.jsonl]\n")
    assert main(["calibrate", "--from-timings", str(timings), "--config", str(config),
                 "--write"]) == 0
    assert f"wrote both keys into the packing: section of {config}" in capsys.readouterr().out
    assert config.read_text() == ("# my run\npacking:\n  global_batch_size: 64   # B\n"
                                  "  attention_cost_constant: 10000  # the old k\n"
                                  "  microbatch_cost_tokens: 2000\n\n"
                                  "data:\n  paths: [a.jsonl]\n")


def test_write_needs_a_config(tmp_path, capsys):
    assert main(["calibrate", "--from-timings", str(_timings(tmp_path / "t.jsonl")),
                 "--write"]) == 2
    assert "--write sets the keys in the --config YAML: give --config FILE" in capsys.readouterr().err


@pytest.mark.parametrize("text,expected", [
    ("data:\n  x: 1\n", "data:\n  x: 1\n\npacking:\n  k: 1\n"),
    ("packing:\n    a: 2\n", "packing:\n    a: 2\n    k: 1\n"),
    ("packing:\n", "packing:\n  k: 1\n"),
    ("packing:\n  k: 5  # old\n  a: 2\nmodel:\n  h: 1\n", "packing:\n  k: 1  # old\n  a: 2\nmodel:\n  h: 1\n"),
])
def test_keys_are_set_by_lines_in_the_packing_block(text, expected):
    assert set_packing_keys(text, {"k": "1"}, "f.yaml") == expected


def test_an_inline_packing_section_is_refused_for_write(tmp_path, capsys):
    config = tmp_path / "sft.yaml"
    config.write_text("packing: {global_batch_size: 64}\n")
    assert main(["calibrate", "--from-timings", str(_timings(tmp_path / "t.jsonl")),
                 "--config", str(config), "--write"]) == 2
    assert "its packing: section is written inline" in capsys.readouterr().err
    assert yaml.safe_load(config.read_text()) == {"packing": {"global_batch_size": 64}}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_without_a_gpu_timing_is_refused_in_one_line(capsys):
    assert main(["calibrate", "--hidden-size", "64", "--num-attention-heads", "4",
                 "--capacity", "128"]) == 2
    printed = capsys.readouterr()
    assert printed.out == ""
    assert printed.err.strip() == (
        "megatron-packing calibrate: error: a GPU is needed to time the layer (no CUDA device is "
        "visible); fit saved timings without one with --from-timings FILE")


@pytest.mark.parametrize("argv,yaml_text,message", [
    (["--num-attention-heads", "4", "--capacity", "128"], None,
     "no --hidden-size given and no model.hidden_size in (no --config)"),
    (["--hidden-size", "65", "--num-attention-heads", "4", "--capacity", "128"], None,
     "the hidden size 65 is not a multiple of the 4 attention heads"),
    (["--hidden-size", "64", "--num-attention-heads", "4"], None, "no --capacity given"),
    ([], "model:\n  hidden_size: 64\n  num_attention_heads: 4\n  dtype: float64\n",
     "model.dtype 'float64' cannot be timed"),
    ([], "model:\n  hidden_size: 0\n  num_attention_heads: 4\n", "model.hidden_size must be"),
    ([], "model:\n  hidden_size: 64\n  num_attention_heads: 4\npacking:\n  bin_capacity: 32\n",
     "bin capacity 32: calibrate needs at least 64 tokens"),
])
def test_a_bad_shape_is_one_line_naming_the_flag_or_key(tmp_path, capsys, argv, yaml_text,
                                                        message):
    if yaml_text is not None:
        config = tmp_path / "sft.yaml"
        config.write_text(yaml_text)
        argv = [*argv, "--config", str(config)]
    assert main(["calibrate", *argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-packing calibrate: error: ") and message in err
    assert len(err.strip().splitlines()) == 1


def test_the_harness_times_each_composition_in_order_until_its_limit():
    shape = LayerShape(16, 2, 32, "fp32")
    compositions = [[8], [4, 4], [2, 2, 2]]
    seen: list[Measured] = []
    timings = time_layer(shape, compositions, device="cpu", repeats=1, warmup=0,
                         report=seen.append)
    assert [m.lengths for m in timings.measured] == [(8,), (4, 4), (2, 2, 2)]
    assert seen == timings.measured and all(m.ms > 0 for m in timings.measured)
    assert timings.backend == "torch layer, scaled_dot_product_attention per sequence"
    assert not timings.stopped_early
    cut = time_layer(shape, compositions, device="cpu", repeats=1, warmup=0, time_limit_s=0.0)
    assert cut.stopped_early and len(cut.measured) == 1  # the limit is checked between rows


@pytest.mark.slow
def test_calibrate_runs_the_harness_on_the_cpu_when_asked(tmp_path, capsys):
    config = tmp_path / "sft.yaml"
    config.write_text("model:\n  hidden_size: 32\n  num_attention_heads: 2\n  ffn_hidden_size: 64\n"
                      "  dtype: float32\npacking:\n  bin_capacity: 64\n")
    out = tmp_path / "cal"
    status = main(["calibrate", "--config", str(config), "--device", "cpu", "--repeats", "1",
                   "--output-dir", str(out)])
    printed = capsys.readouterr()
    assert CPU_NOTE in printed.out
    assert "one layer (hidden 32, 2 heads, FFN 64, fp32) at capacity 64" in printed.out
    timed = [json.loads(line) for line in (out / "timings.jsonl").read_text().splitlines()]
    assert [t["lengths"] for t in timed] == design_compositions(64)
    assert (out / "calibration.md").read_text().strip() == printed.out.strip()
    # CPU timings follow no GPU's model: the fit may come out either way, and says which.
    if status == 0:
        assert printed.out.splitlines()[-2].startswith("attention_cost_constant: ")
        assert printed.out.splitlines()[-1].startswith("microbatch_cost_tokens: ")
    else:
        assert status == 2 and "the fit's constants come out negative" in printed.err


@pytest.mark.parametrize("signature,expected", [("window", {"window_size": (-1, 0)}),
                                                ("causal", {"is_causal": True}),
                                                ("neither", None)])
def test_torch_varlen_attention_is_called_causal_whichever_signature_it_has(monkeypatch, signature,
                                                                            expected):
    from torch.nn.attention import varlen

    from megatron_packing.reports import timing_harness

    calls = []

    def window(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1)):
        calls.append({"window_size": window_size})
        return q

    def causal(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False):
        calls.append({"is_causal": is_causal})
        return q, None

    def neither(q, k, v, cu_q, cu_k, max_q, max_k):
        return q

    monkeypatch.setattr(varlen, "varlen_attn", {"window": window, "causal": causal,
                                                "neither": neither}[signature])
    attend = timing_harness._varlen()
    if expected is None:
        assert attend is None
        return
    q = torch.ones(4, 2, 8)
    assert torch.equal(attend(q, q, q, torch.tensor([0, 4]), 4, [4]), q)
    assert calls == [expected]
