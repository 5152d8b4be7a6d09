#!/usr/bin/env bash
# The main job, installing what it needs into ./.venv on first use.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
exec megatron-packing train --config configs/demo_cpu.yaml "$@"
