#!/usr/bin/env bash
# The GPU checks on a machine with no network and no megatron-core: the throughput sweep
# (benchmarks/bench_gpu_throughput.py), then the smoke test (benchmarks/gpu_smoke.py).
#
# The megatron-core wheel (and any other pure-Python wheel the machine lacks, such as
# nvidia-ml-py for the utilisation column) is installed with --no-deps into a temporary folder
# that goes on PYTHONPATH; nothing is installed into the machine's Python. Outputs go to $OUT
# (a temporary folder when OUT is unset): pip.log, nvidia-smi.txt, bench_gpu_throughput.txt,
# gpu_smoke.txt. Run it from anywhere; it runs in the repository that holds it.
#
# Usage: benchmarks/gpu_device_run.sh MEGATRON_CORE_WHEEL [MORE_WHEELS ...]
# Environment: OUT, PYTHON (default python3), MEGATRON_LM_PATH (for gpu_smoke.py's entry-point
# check; without it that check says it found no Megatron-LM and runs nothing).
set -uo pipefail

if [ "$#" -lt 1 ]; then
    echo "usage: $0 MEGATRON_CORE_WHEEL [MORE_WHEELS ...]  (outputs go to \$OUT)" >&2
    exit 2
fi
for wheel in "$@"; do
    case "$wheel" in
        *.whl) ;;
        *) echo "gpu_device_run: $wheel is not a wheel (.whl) file" >&2; exit 2 ;;
    esac
    if [ ! -f "$wheel" ]; then
        echo "gpu_device_run: no wheel at $wheel" >&2
        exit 2
    fi
done

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"
target="$(mktemp -d)"

if ! "$python" -m pip install --no-deps --no-index --quiet --target "$target" "$@" \
        >"$out/pip.log" 2>&1; then
    echo "gpu_device_run: pip could not install $* (see $out/pip.log)" >&2
    exit 1
fi
export PYTHONPATH="$target:$repo${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1
cd "$repo" || exit 1
nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true

status=0
timeout 420 "$python" benchmarks/bench_gpu_throughput.py 2>&1 | tee "$out/bench_gpu_throughput.txt"
code="${PIPESTATUS[0]}"
[ "$code" -eq 0 ] || { echo "gpu_device_run: the sweep exited $code" >&2; status=1; }
timeout 300 "$python" benchmarks/gpu_smoke.py 2>&1 | tee "$out/gpu_smoke.txt"
code="${PIPESTATUS[0]}"
[ "$code" -eq 0 ] || { echo "gpu_device_run: gpu_smoke.py exited $code" >&2; status=1; }
echo "outputs in $out"
exit "$status"
