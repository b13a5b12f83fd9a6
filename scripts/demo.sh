#!/usr/bin/env bash
# The main demo: DP x TP x SP training of the example Llama on 4 CPU processes,
# compared at the end with the same training in one process. Installs what it needs.
# Extra arguments go to examples/llama/train.py (e.g. --steps 20, --config tiny).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=1
exec .venv/bin/torchrun --standalone --nproc_per_node 4 examples/llama/train.py --dp 2 --tp 2 --sp --steps 40 "$@"
