#!/usr/bin/env bash
# The whole test suite, installing what it needs into ./.venv on first use; then the Megatron
# tiers on the second stack (Python 3.12, megatron-core 0.19, ./.venv312: scripts/test_stack312.sh).
# With no arguments the fast tier runs on MEGATRON_PACKING_TEST_WORKERS processes (default 2,
# pytest-xdist; its tests are in-process and independent), then the slow tier one test at a time
# (its tests launch ranks of their own and time them). Arguments go to one pytest run as given.
# MEGATRON_PACKING_STACK312=0 skips the second stack.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
ruff check megatron_packing tests benchmarks examples
mypy
if [ "$#" -eq 0 ]; then
  python -m pytest -q -p no:cacheprovider -m fast -n "${MEGATRON_PACKING_TEST_WORKERS:-2}"
  python -m pytest -q -p no:cacheprovider -m slow
else
  python -m pytest -q -p no:cacheprovider "$@"
fi
if [ "${MEGATRON_PACKING_STACK312:-1}" != 0 ]; then
  options=()  # pytest options (-m fast, -x, ...) carry over; test paths of the main suite do not
  for arg in "$@"; do
    case "$arg" in tests/*|*.py|*::*) ;; *) options+=("$arg") ;; esac
  done
  bash scripts/test_stack312.sh "${options[@]}"
fi
