# Sourced by the README commands: create or reuse ./.venv and install the project into it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGATRON_PACKING_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
source "$ROOT/scripts/_venv.sh"
use_venv "$VENV" "$PY" "$ROOT/constraints-cpu.txt" "test,demo" \
  "installing megatron_packing and its dependencies into $VENV (about 2 minutes, 2.8 GB)..."
export WANDB_MODE="${WANDB_MODE:-offline}"
cd "$ROOT"
