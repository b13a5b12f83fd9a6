#!/usr/bin/env bash
# GPU checks (run where a GPU is lent; CI has none). Uses the machine's own python3 and torch, no
# install and no network: the library is imported from this checkout.
#   bash scripts/gpu_check.sh     -> progress lines, then a PASS/FAIL/SKIP table with timings
# One GPU: one process (world size 1, NCCL). Several: torchrun over all of them. No CUDA: every
# check is a SKIP and the exit status is 0. Exit 1 if a check failed; the run is bounded by
# GPU_CHECK_TIMEOUT seconds (default 170).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
LIMIT="${GPU_CHECK_TIMEOUT:-170}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! command -v "$PY" >/dev/null 2>&1 || ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "gpu_check: SKIP: no python3 with torch on this machine"
    exit 0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
NGPU="$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)"
if [ "${GPU_CHECK_DEVICE:-cuda}" = "cuda" ] && [ "$NGPU" -gt 1 ]; then
    timeout "$LIMIT" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" scripts/gpu_check.py "$@"
else
    timeout "$LIMIT" "$PY" scripts/gpu_check.py "$@"
fi
rc=$?
if [ "$rc" -eq 124 ]; then
    echo "| total | FAIL | ${LIMIT} s | timed out (GPU_CHECK_TIMEOUT=${LIMIT}) |"
    exit 1
fi
exit "$rc"
