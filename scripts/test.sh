#!/usr/bin/env bash
# The whole test suite, installing what it needs into ./.venv on first use; then the Megatron
# tiers on the second stack (Python 3.12, megatron-core 0.19, ./.venv312: scripts/test_stack312.sh).
# MEGATRON_PACKING_STACK312=0 skips the second stack.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
ruff check megatron_packing tests benchmarks examples
mypy
python -m pytest -q -p no:cacheprovider "$@"
if [ "${MEGATRON_PACKING_STACK312:-1}" != 0 ]; then
  options=()  # pytest options (-m fast, -x, ...) carry over; test paths of the main suite do not
  for arg in "$@"; do
    case "$arg" in tests/*|*.py|*::*) ;; *) options+=("$arg") ;; esac
  done
  bash scripts/test_stack312.sh "${options[@]}"
fi
