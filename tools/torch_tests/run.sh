#!/usr/bin/env bash
# Run one variant (orig | hp | hp_mesh) of the torch DTensor/TP test files, one file at a time.
#   ./run.sh hp                              # all five files, EXCLUDED tests deselected (harness_plugin.py)
#   ./run.sh hp parallel/test_tp_style.py    # one file
#   ALL=1 ./run.sh orig                      # also run the EXCLUDED tests
#   PER_TEST=1 ./run.sh hp test_dtensor.py   # one pytest process per test (test_api.py always: its
#                                            # DTensorContinuousTestBase skips the rest of the class
#                                            # after the first failure)
#   K="expr" TAG_SUFFIX=_k ./run.sh hp test_dtensor.py   # pytest -k expr; the suffix keeps the per-file xml
#   FILE_TIMEOUT=900 (default per pytest process)  TEST_TIMEOUT=600 (pytest-timeout per test)
# Results: results/<variant>/<file-with-dots>[suffix].xml (junit) and .log (pytest -v output).
set -u
cd "$(dirname "$0")"
HERE=$(pwd)
VARIANT=${1:?variant: orig|hp|hp_mesh}
shift
FILES=("$@")
[ ${#FILES[@]} -eq 0 ] && FILES=(test_api.py parallel/test_parallelize_api.py parallel/test_tp_style.py test_redistribute.py test_dtensor.py)
REPO=$(cd "$HERE/../.." && pwd)
PY=$REPO/.venv/bin/python
export PYTHONPATH=$REPO:$HERE/deps:$HERE
export OMP_NUM_THREADS=1
OUT=$HERE/results/$VARIANT
mkdir -p "$OUT"
# record the hyper_parallel source state this run saw (the code is changing under us)
echo "$(date +%T) $VARIANT $* HEAD=$(git -C "$REPO" rev-parse --short HEAD) worktree-diff=$(git -C "$REPO" diff -- hyper_parallel | md5sum | cut -c1-8)" >> "$HERE/results/source_states.txt"

run_one() {  # $1 = pytest target (file or node id), $2 = tag
  local target=$1 tag=$2 start rc
  start=$(date +%s)
  ( cd "$HERE/$VARIANT" && timeout "${FILE_TIMEOUT:-900}" $PY -m pytest "$target" -v -o addopts= --rootdir "$HERE/$VARIANT" -p no:cacheprovider \
      --timeout "${TEST_TIMEOUT:-600}" -o junit_family=xunit2 --junitxml "$OUT/$tag.xml" -p harness_plugin \
      ${K:+-k "$K"} ) > "$OUT/$tag.log" 2>&1
  rc=$?
  echo "    rc=$rc  $(( $(date +%s) - start ))s  $target  $(tail -1 "$OUT/$tag.log")"
}

for f in "${FILES[@]}"; do
  tag=${f//\//.}; tag=${tag%.py}${TAG_SUFFIX:-}
  echo "=== $VARIANT/$f  $(date +%T)"
  if [ "${PER_TEST:-0}" = "1" ] || [ "$f" = "test_api.py" ]; then
    ids=$(cd "$HERE/$VARIANT" && $PY -m pytest "$f" --collect-only -q -o addopts= --rootdir "$HERE/$VARIANT" -p no:cacheprovider -p harness_plugin \
          ${K:+-k "$K"} 2>/dev/null | grep '::')
    for id in $ids; do
      run_one "$id" "${tag}__${id##*::}"
    done
  else
    run_one "$f" "$tag"
  fi
done
