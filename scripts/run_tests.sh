#!/usr/bin/env bash
# Set up .venv if needed, then run pytest (default: tests/, see pyproject.toml).
# Extra arguments go to pytest, e.g.  bash scripts/run_tests.sh tests/harness/test_harness.py -x
# Exit status is pytest's, except that "no tests collected" (5) is a failure (1).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if ! bash scripts/setup_env.sh; then
    echo "run_tests: environment setup failed" >&2
    exit 1
fi

.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "run_tests: pytest collected no tests; treating that as a failure" >&2
    exit 1
fi
exit "$rc"
