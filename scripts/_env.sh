# Sourced by the README commands: create or reuse ./.venv and install the project into it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGATRON_PACKING_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.installed-$(cat "$ROOT/pyproject.toml" "$ROOT/constraints-cpu.txt" | sha256sum | cut -c1-16)"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -c "$ROOT/constraints-cpu.txt" -e "$ROOT[test,demo]"
  rm -f "$VENV"/.installed-*
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export WANDB_MODE="${WANDB_MODE:-offline}"
cd "$ROOT"
