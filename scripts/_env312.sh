# Sourced by scripts/test_stack312.sh: create or reuse ./.venv312 (Python 3.12, megatron-core 0.19.x)
# and install the project with its test extras into it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGATRON_PACKING_VENV312:-$ROOT/.venv312}"
PY="${PYTHON312:-}"
if [ -z "$PY" ]; then
  for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python; do
    if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      PY="$candidate"; break
    fi
  done
fi
if [ -z "$PY" ] && [ ! -x "$VENV/bin/python" ]; then
  echo "the second stack needs Python 3.12: none found (set PYTHON312=/path/to/python3.12)" >&2
  exit 1
fi
STAMP="$VENV/.installed-$(cat "$ROOT/pyproject.toml" "$ROOT/constraints-py312.txt" | sha256sum | cut -c1-16)"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ]; then
  echo "installing megatron_packing (Python 3.12, megatron-core 0.19) into $VENV (about 5 minutes, 5.5 GB: torch's CUDA build)..."
  if ! "$VENV/bin/python" -m pip install -c "$ROOT/constraints-py312.txt" -e "$ROOT[test]" \
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
