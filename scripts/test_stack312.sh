#!/usr/bin/env bash
# The second tested stack: Python 3.12 with megatron-core 0.19 (./.venv312, installed on first
# use). Only the Megatron tiers run here (tests/megatron_lm and tests/megatron), with no
# Megatron-LM checkout: the wheel's megatron.training and the library's GPT provider; and the
# Megatron-Bridge tier (tests/bridge: Bridge 0.6.2 shares this venv, requirements-bridge.txt).
# The cluster-scale launches (tests/cluster: the in-job build, two nodes) run on the main stack
# only: what they test (the shared build's file locks, the rendezvous of two launchers) does not
# depend on the megatron-core release, and together they take about 5 minutes on 2 cores; so do
# the launches marked one_stack (the reason is on each mark), which this stack deselects.
# With no arguments the in-process tests run on two processes, then the launches one at a time;
# extra arguments go to one pytest run (e.g. -m fast).
source "$(dirname "${BASH_SOURCE[0]}")/_env312.sh"
export MEGATRON_LM_PATH=  # empty: no checkout (a 0.16 checkout would shadow 0.19's training)
python -c "from megatron_packing.megatron import compat; import sys; \
print('second stack: Python %s, megatron-core %s' % (sys.version.split()[0], \
compat.version_text(compat.megatron_core_version())))" 2>/dev/null
export MEGATRON_PACKING_SECOND_STACK=1  # deselects the one_stack launches (tests/conftest.py)
TIERS=(tests/megatron_lm tests/megatron tests/bridge)
if [ "$#" -eq 0 ]; then  # as scripts/test.sh: in-process tests on two processes, then launches
  python -m pytest -q -p no:cacheprovider -m fast -n "${MEGATRON_PACKING_TEST_WORKERS:-2}" \
    "${TIERS[@]}"
  exec python -m pytest -q -p no:cacheprovider -m slow --durations=20 "${TIERS[@]}"
fi
exec python -m pytest -q -p no:cacheprovider "${TIERS[@]}" "$@"
