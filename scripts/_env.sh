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
  echo "installing megatron_packing and its dependencies into $VENV (about 2 minutes, 1.4 GB)..."
  if ! "$VENV/bin/python" -m pip install -c "$ROOT/constraints-cpu.txt" -e "$ROOT[test,demo]" \
      > "$VENV/install.log" 2>&1; then
    grep -v "WARNING: Location" "$VENV/install.log" | tail -n 40
    echo "install failed; full log: $VENV/install.log" >&2
    exit 1
  fi
  rm -f "$VENV"/.installed-*
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export WANDB_MODE="${WANDB_MODE:-offline}"
cd "$ROOT"
