"""The device script refuses bad input before it runs anything: one line on stderr, exit 2,
nothing in ``$OUT`` and no temporary folder left behind.

The refusals after the tag check need a GPU check to pass or fail: on this machine torch sees no
GPU, which is the no-GPU case itself. The two refusals that come after a GPU was found (pip
cannot install a wheel; a needed module still does not import) are reached by starting the
script's Python with a ``sitecustomize`` that reports a GPU (and, for the second, hides
``xxhash``); the script itself is run as it is.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.tags import sys_tags

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_device_run.sh"
VERSION = f"{sys.version_info[0]}.{sys.version_info[1]}"


def run_script(tmp_path: Path, *wheels: str, pythonpath: str | None = None,
               python: str = sys.executable) -> subprocess.CompletedProcess[str]:
    """``bash benchmarks/gpu_device_run.sh WHEEL...`` with this Python, an empty ``$OUT`` and a
    temporary folder of its own; checks that neither holds anything of the script's after."""
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    out.mkdir()
    scratch.mkdir()
    env = {**os.environ, "PYTHON": python, "OUT": str(out), "TMPDIR": str(scratch)}
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    done = subprocess.run(["bash", str(SCRIPT), *wheels], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert list(out.iterdir()) == [], "the script wrote to $OUT before refusing"
    assert not list(scratch.glob("gpu_device_run.*")), "the script left its temporary folder"
    return done


def refused(done: subprocess.CompletedProcess[str]) -> str:
    """The one line a refusal prints; nothing ran, so nothing is on stdout."""
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def touch(folder: Path, name: str) -> str:
    (folder / name).write_bytes(b"")
    return name


def test_no_wheels(tmp_path):
    assert refused(run_script(tmp_path)) == (
        "gpu_device_run: no wheels given; usage: bash benchmarks/gpu_device_run.sh WHEEL... (the "
        "wheels this machine lacks; docs/gpu.md lists them)")


def test_a_path_that_is_not_a_wheel(tmp_path):
    name = touch(tmp_path, "megatron_core-0.19.2.tar.gz")
    wheel = touch(tmp_path, "torchdata-0.11.0-py3-none-any.whl")
    assert refused(run_script(tmp_path, wheel, name)) == (
        "gpu_device_run: megatron_core-0.19.2.tar.gz is not a wheel (a .whl file)")


def test_a_wheel_that_does_not_exist(tmp_path):
    assert refused(run_script(tmp_path, "wheels/torchdata-0.11.0-py3-none-any.whl")) == (
        "gpu_device_run: wheels/torchdata-0.11.0-py3-none-any.whl: no such file")


def test_a_wheel_for_another_python(tmp_path):
    other = f"cp{sys.version_info[0]}{sys.version_info[1] - 1}"
    name = touch(tmp_path, f"megatron_core-0.19.2-{other}-{other}-manylinux_2_28_x86_64.whl")
    fits = touch(tmp_path, "torchdata-0.11.0-py3-none-any.whl")
    assert refused(run_script(tmp_path, fits, name)) == (
        f"gpu_device_run: {name} does not fit this machine's Python {VERSION} (wheel tags "
        f"{other}-{other}-manylinux_2_28_x86_64); download it for this Python: pip download "
        f"--no-deps --python-version {VERSION} --only-binary=:all: ... (docs/gpu.md)")


def test_a_wheel_file_name_without_tags(tmp_path):
    name = touch(tmp_path, "megatron_core.whl")
    assert refused(run_script(tmp_path, name)) == (
        "gpu_device_run: megatron_core.whl is not a wheel file name "
        "(name-version-python-abi-platform.whl)")


def test_no_python(tmp_path):
    wheel = touch(tmp_path, "torchdata-0.11.0-py3-none-any.whl")
    python = str(tmp_path / "no" / "python3")
    assert refused(run_script(tmp_path, wheel, python=python)) == (
        f"gpu_device_run: no Python at '{python}' (set PYTHON)")


@pytest.mark.slow
def test_no_gpu_after_wheels_that_fit(tmp_path):
    """Wheels for any Python (py3-none-any) and for exactly this one pass the tag check; then
    the missing GPU stops the script."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the script does not refuse it")
    tag = next(iter(sys_tags()))
    fits = [touch(tmp_path, "torchdata-0.11.0-py3-none-any.whl"),
            touch(tmp_path, f"megatron_core-0.19.2-{tag.interpreter}-{tag.abi}-{tag.platform}.whl")]

    assert refused(run_script(tmp_path, *fits)) == (
        f"gpu_device_run: no CUDA GPU here (torch.cuda.is_available() is False with "
        f"{sys.executable}, torch {torch.__version__}); run it on a GPU machine")


def _seen_gpu(tmp_path: Path, *, hide: str | None = None) -> str:
    """A folder whose ``sitecustomize`` makes torch report a GPU (and hides module ``hide``)."""
    folder = tmp_path / "seen_gpu"
    folder.mkdir()
    lines = ["import sys", "import torch", "torch.cuda.is_available = lambda: True"]
    if hide is not None:
        lines.append(f"sys.modules[{hide!r}] = None")
    (folder / "sitecustomize.py").write_text("\n".join(lines) + "\n")
    return str(folder)


def _small_wheel(folder: Path) -> str:
    """A valid pure-Python wheel of one empty package."""
    name = "small_pkg-1.0-py3-none-any.whl"
    info = "small_pkg-1.0.dist-info"
    files = {"small_pkg/__init__.py": "",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: small-pkg\nVersion: 1.0\n",
             f"{info}/WHEEL": ("Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                               "Tag: py3-none-any\n")}
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / name, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return name


def _training_importable() -> bool:
    """Whether this Python, started as the script starts it, finds ``megatron.training``."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", "import importlib.util; print(importlib.util."
                           "find_spec('megatron.training') is not None)"],
                          env=env, capture_output=True, text=True, timeout=120, check=True)
    return done.stdout.strip() == "True"


@pytest.mark.slow
def test_a_wheel_pip_cannot_install(tmp_path):
    wheel = touch(tmp_path, "torchdata-0.11.0-py3-none-any.whl")  # an empty file, no zip
    line = refused(run_script(tmp_path, wheel, pythonpath=_seen_gpu(tmp_path)))
    # The reason after the colon is pip's own last error line.
    assert line.startswith("gpu_device_run: pip could not install the wheels: ERROR: ")
    assert "torchdata" in line and "invalid" in line


@pytest.mark.slow
def test_a_needed_module_that_still_does_not_import(tmp_path):
    wheel = _small_wheel(tmp_path)
    line = refused(run_script(tmp_path, wheel, pythonpath=_seen_gpu(tmp_path, hide="xxhash")))
    missing = ["xxhash (ModuleNotFoundError: import of xxhash halted; None in sys.modules; "
               "carry the xxhash wheel)"]
    if not _training_importable():  # megatron-core before 0.19, no checkout on the path
        missing.append("megatron.training.training (ModuleNotFoundError: No module named "
                       "'megatron.training'; carry the megatron-core>=0.19 wheel)")
    assert line == ("gpu_device_run: after installing the wheels, these still do not import: "
                    + "; ".join(missing) + " (docs/gpu.md)")
