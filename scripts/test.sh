#!/usr/bin/env bash
# The whole test suite, installing what it needs into ./.venv on first use.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
ruff check megatron_packing tests benchmarks examples
mypy
exec python -m pytest -q -p no:cacheprovider "$@"
