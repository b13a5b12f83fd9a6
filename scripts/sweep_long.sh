#!/usr/bin/env bash
# The long profile of the property-based sweep (tests/dispatch/test_property_sweep.py): more examples per
# family and world size, shrinking on (a failure is reduced to a minimal Case before it is printed).
#   bash scripts/sweep_long.sh                 # 150 examples per family / world size, derandomized
#   HP_SWEEP_EXAMPLES=1000 HP_SWEEP_SEED=7 bash scripts/sweep_long.sh   # another, longer draw
# Extra arguments go to pytest (e.g. -k "4_ranks and matmul").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
export HYPOTHESIS_PROFILE=long
export HP_SWEEP_EXAMPLES="${HP_SWEEP_EXAMPLES:-150}"
echo "sweep_long: $HP_SWEEP_EXAMPLES examples per family and world size, seed ${HP_SWEEP_SEED:-derandomized}" >&2
exec .venv/bin/python -m pytest tests/dispatch/test_property_sweep.py -p no:cacheprovider -o addopts="-q -ra" \
    --timeout 0 "$@"
