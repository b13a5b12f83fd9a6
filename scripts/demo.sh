#!/usr/bin/env bash
# The main demo: FSDP x TP x SP training of the example Llama on 4 CPU processes
# (parameters, gradients and optimizer states sharded over dp_shard=2, Megatron TP+SP over tp=2),
# compared at the end with the same training in one process; prints every rank's
# parameter+gradient+optimizer bytes next to the unsharded total. Installs what it needs.
# Extra arguments go to examples/llama/train.py (e.g. --steps 20, --config tiny).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=1
exec .venv/bin/torchrun --standalone --nproc_per_node 4 examples/llama/train.py --dp-shard 2 --tp 2 --sp --steps 40 "$@"
