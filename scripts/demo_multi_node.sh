#!/usr/bin/env bash
# The main demo (FSDP x TP x SP training of the example Llama, compared with one process) across
# two torchrun agents on this machine, as two "nodes" of 2 processes each would run it:
#   torchrun --nnodes 2 --node-rank {0,1} --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT
# On real nodes run one agent per node with the first node's address (docs/multi_node.md).
# Extra arguments go to examples/llama/train.py (e.g. --steps 20, --config tiny).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=1
port=$(.venv/bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
pids=()
for node in 0 1; do
  .venv/bin/torchrun --nnodes 2 --node-rank "$node" --nproc-per-node 2 \
      --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$port" --rdzv-id "hp-demo-$port" \
      examples/llama/train.py --dp-shard 2 --tp 2 --sp --steps 40 "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
