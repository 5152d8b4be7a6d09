#!/usr/bin/env bash
# Every GPU check in one command, on a machine with no network: the GPU test tier (tests/gpu),
# the padded-mode throughput sweep (benchmarks/bench_gpu_throughput.py) and the step-cost
# calibration (megatron-packing calibrate) at two model shapes, in at most 8 minutes.
#
# Usage: bash benchmarks/gpu_device_run.sh WHEEL...
#   WHEEL: the wheels this machine lacks (megatron-core 0.19, torchdata, pytest and its
#   dependencies, xxhash, psutil, einops; docs/gpu.md has the one `pip download` line). They are
#   installed with pip --no-deps --no-index into a temporary folder put first on PYTHONPATH;
#   nothing is installed into the machine's Python.
# Environment: OUT (default: a new temporary folder) receives every table and log;
#   PYTHON (default python3).
#
# Checked before anything runs, each failure one line on stderr and exit 2 with nothing written
# to OUT: no wheels; a path that is no .whl file or does not exist; a wheel whose tags this Python
# cannot install; no CUDA GPU; pip failing to install the wheels; a module the tier needs that
# still does not import once they are installed. Then each part runs under its own time limit;
# OUT/summary.txt holds each part's status and seconds, and the total. Exit 0 when every part
# passed, else 1.
set -uo pipefail

refuse() {
    echo "gpu_device_run: $*" >&2
    exit 2
}

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
started=$SECONDS

# ------------------------------------------------------------------------------ bad input
[ "$#" -ge 1 ] || refuse "no wheels given; usage: bash benchmarks/gpu_device_run.sh WHEEL... (the wheels this machine lacks; docs/gpu.md lists them)"
for wheel in "$@"; do
    case "$wheel" in
        *.whl) ;;
        *) refuse "$wheel is not a wheel (a .whl file)" ;;
    esac
    [ -f "$wheel" ] || refuse "$wheel: no such file"
done
command -v "$python" >/dev/null 2>&1 || refuse "no Python at '$python' (set PYTHON)"

# Each wheel's tags, read from its file name, against the tags this Python installs (pip's own
# rule); then the GPU.
"$python" - "$@" <<'PY' || exit 2
import os
import sys

try:
    from packaging.tags import sys_tags
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename
except ImportError:
    from pip._vendor.packaging.tags import sys_tags
    from pip._vendor.packaging.utils import InvalidWheelFilename, parse_wheel_filename


def refuse(message):
    print(f"gpu_device_run: {message}", file=sys.stderr)
    sys.exit(2)


version = f"{sys.version_info[0]}.{sys.version_info[1]}"
supported = set(sys_tags())
for path in sys.argv[1:]:
    name = os.path.basename(path)
    try:
        tags = parse_wheel_filename(name)[3]
    except InvalidWheelFilename:
        refuse(f"{name} is not a wheel file name (name-version-python-abi-platform.whl)")
    if not tags & supported:
        built_for = "-".join(name[:-len(".whl")].split("-")[-3:])
        refuse(f"{name} does not fit this machine's Python {version} (wheel tags {built_for}); "
               f"download it for this Python: pip download --no-deps --python-version {version} "
               "--only-binary=:all: ... (docs/gpu.md)")
try:
    import torch
except Exception as error:
    refuse(f"torch does not import with {sys.executable} ({type(error).__name__}: {error})")
if not torch.cuda.is_available():
    refuse(f"no CUDA GPU here (torch.cuda.is_available() is False with {sys.executable}, "
           f"torch {torch.__version__}); run it on a GPU machine")
PY

work="$(mktemp -d -t gpu_device_run.XXXXXX)"
trap 'rm -rf "$work"' EXIT
if ! "$python" -m pip install --no-deps --no-index --disable-pip-version-check \
        --target "$work/site" "$@" >"$work/pip.log" 2>&1; then
    reason="$(grep -E '^ERROR' "$work/pip.log" | tail -n 1)"
    refuse "pip could not install the wheels: ${reason:-$(tail -n 1 "$work/pip.log")}"
fi
export PYTHONPATH="$work/site:$repo${PYTHONPATH:+:$PYTHONPATH}"
export MEGATRON_LM_PATH="" CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1

# What the tier and the entry point import, each with the wheel that brings it.
"$python" - <<'PY' || exit 2
import contextlib
import importlib
import io
import sys
import warnings

NEEDED = [
    ("pytest", "pytest"), ("numpy", "numpy"), ("yaml", "pyyaml"), ("jinja2", "jinja2"),
    ("tqdm", "tqdm"), ("tokenizers", "tokenizers"), ("transformers", "transformers"),
    ("xxhash", "xxhash"), ("psutil", "psutil"), ("torchdata.stateful_dataloader", "torchdata"),
    ("megatron.core", "megatron-core"), ("megatron.training.training", "megatron-core>=0.19"),
    ("megatron.core.datasets.helpers_cpp", "megatron-core built for this Python"),
    ("megatron_packing.megatron_lm.entry", "megatron-core"),
]
WHEEL_OF = {"yaml": "pyyaml", "megatron": "megatron-core>=0.19", "_pytest": "pytest"}
warnings.simplefilter("ignore")  # third-party import warnings are not this check's output
missing, reported = [], set()
for module, wheel in NEEDED:
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            importlib.import_module(module)
    except ImportError as error:
        top = (getattr(error, "name", None) or module).split(".")[0]
        if top in reported:  # the same missing package, met again through another module
            continue
        reported.add(top)
        carry = wheel if top == module.split(".")[0] else WHEEL_OF.get(top, top)
        missing.append(f"{module} ({type(error).__name__}: {error}; carry the {carry} wheel)")
    except (Exception, SystemExit) as error:  # e.g. a megatron-core outside the supported range
        if module.split(".")[0] in reported:
            continue
        reported.add(module.split(".")[0])
        why = (str(error) or printed.getvalue() or type(error).__name__).strip().splitlines()[0]
        missing.append(f"{module} ({type(error).__name__}: {why})")
if missing:
    print("gpu_device_run: after installing the wheels, these still do not import: "
          + "; ".join(missing) + " (docs/gpu.md)", file=sys.stderr)
    sys.exit(2)
PY

# ------------------------------------------------------------------------------ the run
out="${OUT:-$(mktemp -d -t gpu_device_out.XXXXXX)}"
mkdir -p "$out"
cp "$work/pip.log" "$out/pip.log"
cd "$repo" || exit 1
nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true

# Every part ends within DEADLINE_S of the start (8 minutes less a margin): each runs at most its
# own limit, and never into the seconds kept for the parts after it.
DEADLINE_S=465
KILL_AFTER_S=5
summary=()
failed=0

# run_part NAME LIMIT_S RESERVE_S LOG COMMAND...: COMMAND's output goes to LOG, its status and
# seconds to the summary. At its limit it gets SIGINT (pytest still writes its report then), and
# SIGKILL KILL_AFTER_S later.
run_part() {
    local name="$1" limit="$2" reserve="$3" log="$4"
    shift 4
    local left=$((DEADLINE_S - (SECONDS - started) - reserve - KILL_AFTER_S))
    [ "$left" -lt "$limit" ] && limit=$left
    local began=$SECONDS status code
    if [ "$limit" -lt 10 ]; then
        status="not run: no time left"
        failed=1
    else
        echo "== $name (at most ${limit} s) -> $log"
        timeout --signal=INT --kill-after="$KILL_AFTER_S" "$limit" "$@" >"$log" 2>&1
        code=$?
        case "$code" in
            0) status="passed" ;;
            124 | 137) status="timed out after ${limit} s"; failed=1 ;;
            *) status="FAILED (exit $code)"; failed=1 ;;
        esac
    fi
    summary+=("| $name | $status | $((SECONDS - began)) |")
    echo "   $status in $((SECONDS - began)) s"
}

# Kept for the parts after the tier: the sweep (90 + 5 s) and two calibrations (45 + 5 s each).
run_part "GPU tier (tests/gpu)" 270 195 "$out/gpu_tier.log" \
    "$python" -m pytest tests/gpu -m gpu -p no:cacheprovider -q -rA \
    --junitxml="$out/gpu_tier.xml"
# The tier's table: test, result, seconds, and why a test was skipped or failed.
"$python" - "$out/gpu_tier.xml" >"$out/gpu_tier.txt" 2>&1 <<'PY'
import sys
import xml.etree.ElementTree as ElementTree

try:
    cases = list(ElementTree.parse(sys.argv[1]).getroot().iter("testcase"))
except (OSError, ElementTree.ParseError) as error:
    print(f"no report from pytest ({error}); see gpu_tier.log")
    sys.exit(0)
print("| test | result | s | detail |")
print("|---|---|---|---|")
for case in cases:
    result, detail = "passed", ""
    for tag, word in (("failure", "FAILED"), ("error", "ERROR"), ("skipped", "skipped")):
        found = case.find(tag)
        if found is not None:
            result = word
            detail = ((found.get("message") or "").splitlines() or [""])[0][:200]
            break
    name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
    print(f"| {name} | {result} | {float(case.get('time', 0)):.1f} | {detail.replace('|', '/')} |")
PY
cat "$out/gpu_tier.txt"

run_part "throughput sweep (bench_gpu_throughput.py)" 90 100 "$out/bench_gpu_throughput.txt" \
    "$python" benchmarks/bench_gpu_throughput.py --time-limit-s 55

for shape in "2048 16 5632 50" "4096 32 11008 0"; do
    read -r hidden heads ffn reserve <<<"$shape"
    run_part "calibrate hidden $hidden" 45 "$reserve" "$out/calibrate_h$hidden.log" \
        "$python" -m megatron_packing.cli calibrate --hidden-size "$hidden" \
        --num-attention-heads "$heads" --ffn-hidden-size "$ffn" --dtype bf16 --capacity 8192 \
        --time-limit-s 30 --output-dir "$out/calibrate_h$hidden"
done

{
    echo "| part | status | s |"
    echo "|---|---|---|"
    printf '%s\n' "${summary[@]}"
    echo "total $((SECONDS - started)) s (checks and install included)"
} >"$out/summary.txt"
cat "$out/summary.txt"
echo "outputs in $out"
exit "$failed"
