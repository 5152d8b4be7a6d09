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
source "$ROOT/scripts/_venv.sh"
# torch's CUDA build needs room: about 5.5 GB installed plus its downloads while pip unpacks them.
# Say so before pip starts rather than failing midway with "No space left on device".
# MEGATRON_PACKING_STACK312_FREE_GB sets the room asked for (default 8, in GB).
NEED_GB="${MEGATRON_PACKING_STACK312_FREE_GB:-8}"
if ! [[ "$NEED_GB" =~ ^[0-9]+$ ]]; then
  echo "MEGATRON_PACKING_STACK312_FREE_GB must be a whole number of GB, got '$NEED_GB'" >&2
  exit 1
fi
if ! venv_installed "$VENV"; then
  mkdir -p "$(dirname "$VENV")"
  free_kb="$(df -Pk "$(dirname "$VENV")" | awk 'NR == 2 {print $4}')"
  if [ "$free_kb" -lt $((NEED_GB * 1024 * 1024)) ]; then
    echo "the second stack needs about $NEED_GB GB free to install into $VENV;" \
      "$(dirname "$VENV") has $((free_kb / 1024 / 1024)) GB: free some space, point" \
      "MEGATRON_PACKING_VENV312 at a disk with room, or set MEGATRON_PACKING_STACK312=0 to skip" \
      "the second stack" >&2
    exit 1
  fi
fi
# MEGATRON_PACKING_STACK312_TORCH_ONLY=1 (scripts/test.sh, in the background while the main suite
# starts): create the venv and install only torch, the bulk of the download; the install below
# then adds the rest and reports any failure, torch's included.
if [ "${MEGATRON_PACKING_STACK312_TORCH_ONLY:-0}" = 1 ]; then
  if ! venv_installed "$VENV"; then
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -c "$ROOT/constraints-py312.txt" torch \
      > "$VENV/torch-install.log" 2>&1 || true
  fi
  return 0
fi
use_venv "$VENV" "$PY" "$ROOT/constraints-py312.txt" "test" \
  "installing megatron_packing (Python 3.12, megatron-core 0.19) into $VENV (about 5 minutes, 5.5 GB: torch's CUDA build)..."
# The Bridge tier (tests/bridge): Megatron-Bridge and what it imports, in this venv.
# MEGATRON_PACKING_BRIDGE=0 leaves it out (its tests then skip, saying why).
if [ "${MEGATRON_PACKING_BRIDGE:-1}" != 0 ]; then
  bridge_stamp="$VENV/.bridge-$(cat "$ROOT/requirements-bridge.txt" "$ROOT/constraints-py312.txt" \
    | sha256sum | cut -c1-16)"
  if [ ! -f "$bridge_stamp" ]; then
    echo "installing Megatron-Bridge 0.6.2 and its imports into $VENV (about a minute)..."
    if ! { "$VENV/bin/python" -m pip install -c "$ROOT/constraints-py312.txt" \
             -r "$ROOT/requirements-bridge.txt" \
        && "$VENV/bin/python" -m pip install --no-deps -c "$ROOT/constraints-py312.txt" \
             megatron-bridge; } > "$VENV/bridge-install.log" 2>&1; then
      grep -v "WARNING: Location" "$VENV/bridge-install.log" | tail -n 40
      echo "the Bridge tier's install failed; full log: $VENV/bridge-install.log" >&2
      exit 1
    fi
    rm -f "$VENV"/.bridge-*
    touch "$bridge_stamp"
  fi
fi
export WANDB_MODE="${WANDB_MODE:-offline}"
cd "$ROOT"
