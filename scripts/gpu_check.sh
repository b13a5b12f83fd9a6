#!/usr/bin/env bash
# GPU checks on one CUDA device (run where a GPU is lent; CI has none). Uses the machine's own
# python3 and torch: the library is imported from this checkout (no install needed).
#   bash scripts/gpu_check.sh          -> a PASS/FAIL/SKIP table; exit 1 if a check failed
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 exec "$PY" scripts/gpu_check.py "$@"
