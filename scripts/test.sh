#!/usr/bin/env bash
# The whole test suite, installing what it needs into ./.venv on first use; then the Megatron
# tiers on the second stack (Python 3.12, megatron-core 0.19, ./.venv312: scripts/test_stack312.sh).
# With no arguments the fast tier runs on MEGATRON_PACKING_TEST_WORKERS processes (default 2,
# pytest-xdist; its tests are in-process and independent), then the slow tier one test at a time
# (its tests launch ranks of their own and time them). Arguments go to one pytest run as given.
# MEGATRON_PACKING_STACK312=0 skips the second stack.
STACK312="${MEGATRON_PACKING_STACK312:-1}"
if [ "$STACK312" != 0 ]; then
  # The second stack's torch (a multi-GB download) installs while the main venv installs and the
  # fast tier runs; it is awaited before the slow tier, whose launches time themselves.
  MEGATRON_PACKING_STACK312_TORCH_ONLY=1 bash -c 'source "$1"' _ \
    "$(dirname "${BASH_SOURCE[0]}")/_env312.sh" &
  torch312=$!
  trap '{ pkill -P "$torch312"; kill "$torch312"; } 2> /dev/null || true' EXIT  # keeps the status
fi
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
ruff check megatron_packing tests benchmarks examples
mypy
await_torch312() {
  if [ "$STACK312" != 0 ]; then wait "$torch312" || true; fi
}
if [ "$#" -eq 0 ]; then
  python -m pytest -q -p no:cacheprovider -m fast -n "${MEGATRON_PACKING_TEST_WORKERS:-2}"
  await_torch312
  python -m pytest -q -p no:cacheprovider -m slow --durations=20
else
  await_torch312
  python -m pytest -q -p no:cacheprovider "$@"
fi
if [ "$STACK312" != 0 ]; then
  options=()  # pytest options (-m fast, -x, ...) carry over; test paths of the main suite do not
  for arg in "$@"; do
    case "$arg" in tests/*|*.py|*::*) ;; *) options+=("$arg") ;; esac
  done
  bash scripts/test_stack312.sh "${options[@]}"
fi
