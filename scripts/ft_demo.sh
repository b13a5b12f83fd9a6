#!/usr/bin/env bash
# Replica groups that survive a lost group without a restart (torchft; docs/fault_tolerance.md):
# starts a real torchft_lighthouse on a free 127.0.0.1 port and N replica groups of M ranks on this
# machine (each group its own torchrun job: FSDP over its M ranks), training the example Llama.
# With --kill-at STEP group N-1 is SIGKILLed (every rank) inside the backward of STEP and a spare
# (started at launch, waiting on a gate file) takes its place RESTART_DELAY seconds later: the others
# keep stepping, the spare heals from a live group.
#
#   scripts/ft_demo.sh                                   # 2 groups x 2 ranks, demo config, 40 steps
#   scripts/ft_demo.sh --kill-at 15                      # ... and kill + restart group 1
#   GROUPS_N=3 RANKS=1 scripts/ft_demo.sh --ft-semi-sync diloco --sync-every 8   # DiLoCo across 3 groups
#
# Environment: GROUPS_N (default 2), RANKS (2), MIN_REPLICAS (default: a majority of the groups;
# 1 lets one survivor of 2 groups go on), RESTART_DELAY (0), OUT (a temporary directory: logs and
# each group's per-step JSON lines). Other arguments go to examples/llama/train.py.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup_env.sh
export OMP_NUM_THREADS=1
PY=.venv/bin/python
N=${GROUPS_N:-2}; M=${RANKS:-2}
MIN=${MIN_REPLICAS:-$(( N / 2 + 1 ))}
OUT=${OUT:-$(mktemp -d /tmp/ft_demo.XXXXXX)}; mkdir -p "$OUT"
KILL_AT=""; ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --kill-at) KILL_AT="$2"; shift 2 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
if [ -n "$KILL_AT" ] && [ "$N" -eq 2 ] && [ -z "${MIN_REPLICAS:-}" ]; then
  MIN=1  # with 2 groups a majority is both: let the survivor go on alone (the no-solo-before-peer guard stays)
fi
port() { "$PY" -c "from hyper_parallel.ft.lighthouse import free_port; print(free_port())"; }
LH_PORT=$(port)
.venv/bin/torchft_lighthouse --bind "127.0.0.1:$LH_PORT" --min_replicas "$MIN" --quorum_tick_ms 100 \
  --join_timeout_ms 5000 --heartbeat_timeout_ms 5000 > "$OUT/lighthouse.log" 2>&1 &
LH_PID=$!
PIDS=()
cleanup() {  # only the processes this script started
  for p in "${PIDS[@]}" "$LH_PID"; do kill "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
echo "ft_demo: lighthouse 127.0.0.1:$LH_PORT (min_replicas $MIN), $N groups x $M ranks; logs in $OUT"
start_group() {  # $1 = group id, $2 = log suffix, then extra env assignments
  local g=$1 suffix=$2; shift 2
  env "$@" .venv/bin/torchrun --nnodes 1 --nproc_per_node "$M" --master_addr 127.0.0.1 --master_port "$(port)" \
    examples/llama/train.py --config demo --steps 40 --dp-shard "$M" --ft-replica-group-id "$g" \
    --ft-num-replica-groups "$N" --ft-min-replicas "$MIN" --ft-lighthouse "127.0.0.1:$LH_PORT" \
    --ft-log "$OUT/group$g$suffix.jsonl" --ft-alone-timeout 120 "${ARGS[@]}" > "$OUT/group$g$suffix.log" 2>&1 &
  PIDS+=($!)
}
for g in $(seq 0 $((N - 1))); do
  if [ -n "$KILL_AT" ] && [ "$g" -eq $((N - 1)) ]; then
    start_group "$g" "" HP_TEST_FT_KILL_AT_STEP="$KILL_AT"
    VICTIM=$!
  else
    start_group "$g" ""
  fi
done
if [ -n "$KILL_AT" ]; then
  # the restart is a spare started now (imports done, model built) that joins once the gate file exists:
  # a cold start takes longer than the survivors' remaining steps of a short demo on a loaded CPU
  start_group $((N - 1)) "_restarted" HP_FT_START_GATE="$OUT/spare.go"
  wait "$VICTIM" || true
  echo "ft_demo: group $((N - 1)) was killed in the backward of step $KILL_AT; its spare joins in ${RESTART_DELAY:-0}s"
  sleep "${RESTART_DELAY:-0}"
  touch "$OUT/spare.go"
fi
STATUS=0
for p in "${PIDS[@]}"; do
  if [ -n "$KILL_AT" ] && [ "$p" = "${VICTIM:-}" ]; then continue; fi
  wait "$p" || STATUS=$?
done
"$PY" - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for path in sorted(out.glob("group*.jsonl")):
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    done = [r for r in recs if r["committed"]]
    if not done:
        print(f"{path.stem}: no committed step"); continue
    print(f"{path.stem}: committed steps {done[0]['step']}..{done[-1]['step']} ({len(done)}), not committed "
          f"{len(recs) - len(done)}, loss {done[0]['loss']:.4f} -> {done[-1]['loss']:.4f}, mean step "
          f"{sum(r['seconds'] for r in done) / len(done):.3f}s, longest quorum wait "
          f"{max(r['quorum_seconds'] for r in recs):.2f}s, {done[-1]['bytes']:,} cross-group bytes")
PYEOF
exit $STATUS
