#!/usr/bin/env bash
# Create / refresh the project virtualenv in .venv (idempotent, quiet).
#
#   1. .venv from python3.11 if available, else python3 (must be >= 3.11)
#   2. torch==2.13.0 explicitly FIRST (the local CPU wheel; a looser spec
#      would make pip fetch a CUDA build of several GB)
#   3. pip install -e ".[test,demo]"   (torch is then already satisfied)
#
# A stamp file keyed on pyproject.toml + this script makes re-runs a no-op
# (~0.1 s) as long as the venv still has torch 2.13.0 and the package.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VENV="$ROOT/.venv"
PY="$VENV/bin/python"
STAMP="$VENV/.hp_setup_stamp"
LOG="$VENV/.hp_setup.log"
TORCH_VERSION="2.13.0"

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

log() { echo "setup_env: $*" >&2; }

hash_inputs() {
    if command -v sha256sum >/dev/null 2>&1; then
        cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -d' ' -f1
    else
        cat pyproject.toml scripts/setup_env.sh | shasum -a 256 | cut -d' ' -f1
    fi
}

venv_ok() {  # usable interpreter with torch 2.13.0, our package and the test extra (hypothesis) installed
    [ -x "$PY" ] && "$PY" - "$TORCH_VERSION" <<'PYEOF' >/dev/null 2>&1
import sys
import importlib.metadata as md
assert sys.version_info >= (3, 11)
assert md.version("torch").split("+")[0] == sys.argv[1]
md.version("hyper-parallel")
md.version("hypothesis")  # the [test] extra (tests/dispatch/test_property_sweep.py)
PYEOF
}

KEY="$(hash_inputs)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ] && venv_ok; then
    exit 0
fi

# --- 1. the virtualenv -------------------------------------------------------
if ! { [ -x "$PY" ] && "$PY" -c 'import sys; assert sys.version_info >= (3, 11)' >/dev/null 2>&1; }; then
    BASE=""
    for cand in python3.11 python3; do
        if command -v "$cand" >/dev/null 2>&1 &&
           "$cand" -c 'import sys; assert sys.version_info >= (3, 11)' >/dev/null 2>&1; then
            BASE="$cand"
            break
        fi
    done
    if [ -z "$BASE" ]; then
        log "need python3.11 (or a newer python3) on PATH"
        exit 1
    fi
    log "creating .venv with $("$BASE" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
    rm -rf "$VENV"
    "$BASE" -m venv "$VENV"
fi

run_pip() {
    if ! "$PY" -m pip install "$@" >>"$LOG" 2>&1; then
        log "pip install $* failed; last lines of $LOG:"
        tail -n 40 "$LOG" >&2
        exit 1
    fi
}

: >"$LOG"
rm -f "$STAMP"

# --- 2. torch first, pinned ----------------------------------------------------
if ! "$PY" -c "import importlib.metadata as md, sys; sys.exit(md.version('torch').split('+')[0] != '$TORCH_VERSION')" >/dev/null 2>&1; then
    log "installing torch==$TORCH_VERSION"
    run_pip -q "torch==$TORCH_VERSION"
fi

# --- 3. the package, editable, with extras ------------------------------------
# setuptools >= 70.1 builds PEP 660 editable wheels without the `wheel` package;
# building in the venv itself avoids a throw-away isolated build environment.
if ! "$PY" -c "import setuptools, sys; sys.exit(tuple(map(int, setuptools.__version__.split('.')[:2])) < (70, 1))" >/dev/null 2>&1; then
    run_pip -q "setuptools>=70.1"
fi
log "installing hyper-parallel (editable) with [test,demo]"
run_pip -q --no-build-isolation -e ".[test,demo]"

if ! venv_ok; then
    log "environment check failed after install (torch==$TORCH_VERSION + hyper-parallel expected)"
    exit 1
fi
echo "$KEY" >"$STAMP"
