#!/usr/bin/env bash
# torchtitan 0.3.0 on torch and on hyper_parallel, side by side (issue 31).
#
#   bash scripts/torchtitan_check.sh                 # the whole matrix
#   ROWS="fsdp2 tp2" bash scripts/torchtitan_check.sh  # some rows
#   STEPS=5 OUT=runs/torchtitan bash scripts/torchtitan_check.sh
#   INIT=seed SEED=42 ROWS="fsdp2 tp2" bash scripts/torchtitan_check.sh   # no loaded weights: both stacks
#       initialise from the same seed (--debug.seed); their initial weights and step-1 losses are compared
#   TOL=1e-6 ROWS="fsdp2_fd tp2_fd fsdp2tp2_fd" bash scripts/torchtitan_check.sh   # torchtitan's full_dtensor
#   DUMP_GRADS=1 ...   # also write each stack's full step-1 gradients (grads-<stack>-<row>.pt)
#   ROWS="dcpx_fsdp2tp2 dcpx_moe_ep2" ...   # DCP checkpoints across the stacks (see the dcpx block)
#   ROWS=ft ...        # torchtitan fault tolerance, 2 replica groups, one killed and healed
#   PROFILE=1 ...      # also a cProfile of train_step from step 2 on, rank 0 (prof-<stack>-<row>.pstats)
#
# * .venv-torchtitan (git-ignored, not the test suite's .venv): torch==2.13.0 (CPU), torchtitan==0.3.0,
#   this package (editable, no dependencies).
# * Each row runs torchtitan's own train loop twice on gloo ranks (torchrun, a free port each): on torch
#   (which writes its initial weights) and under hyper_parallel.swap (which loads them), then prints
#   the losses and grad norms side by side, their largest relative differences (verdict: both within TOL,
#   default 1e-5) and the step-time ratio.
# * The only changes to torchtitan are the CPU patches in scripts/torchtitan/run_titan.py (device "cpu",
#   a stub for the triton-only kernel module, SUM instead of PREMUL_SUM on gloo, no
#   torch.distributed.set_timeout), applied to both stacks; the model is torchtitan's llama3
#   debugmodel / qwen3 MoE debug config with its SDPA inner attention, float32 parameters
#   (scripts/torchtitan/titan_configs.py). Results: docs/torchtitan.md.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv-torchtitan"
PY="$VENV/bin/python"
OUT="${OUT:-$ROOT/runs/torchtitan}"
STEPS="${STEPS:-5}"
INIT="${INIT:-load}"      # load: hyper_parallel loads torch's initial weights; seed: both initialise from SEED
SEED="${SEED:-42}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
mkdir -p "$OUT"

if ! "$PY" -c "import torchtitan, hyper_parallel, torch; assert torch.__version__.startswith('2.13.0')" 2>/dev/null; then
    echo "torchtitan_check: creating $VENV (torch 2.13.0 CPU, torchtitan 0.3.0)" >&2
    [ -x "$PY" ] || python3.11 -m venv "$VENV" || python3 -m venv "$VENV"
    "$PY" -m pip install -q "torch==2.13.0" >"$OUT/pip.log" 2>&1 &&
    "$PY" -m pip install -q "torchtitan==0.3.0" "torchft==0.2.0" >>"$OUT/pip.log" 2>&1 &&
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . >>"$OUT/pip.log" 2>&1 ||
        { echo "torchtitan_check: pip failed, see $OUT/pip.log" >&2; tail -20 "$OUT/pip.log" >&2; exit 1; }
fi
[ -f "$OUT/assets/tokenizer/tokenizer.json" ] || "$PY" scripts/torchtitan/make_assets.py "$OUT/assets" >/dev/null

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

LLAMA=llama3_debugmodel_sdpa_noac
# name | ranks | config | torchtitan arguments [| torch's arguments, where torch cannot run the row itself]
# cp rows: torch 2.13 has no CPU sharding strategy for its flash SDPA op, so torch's own CP fails on CPU;
# hyper_parallel's CP2 is compared with torch on the same 2 ranks WITHOUT CP and the same global batch
# and data (TP2: data-parallel degree 1, so both stacks train on the same 2 sequences a step).
# _fd rows: torchtitan's full_dtensor backend (every parameter, buffer and input a DTensor on the whole
# dense mesh; fully_shard with DataParallelMeshDims); the later --parallelism.spmd-backend wins.
MATRIX="
fsdp2|2|$LLAMA|
fsdp2_ac|2|llama3_debugmodel_sdpa|
tp2_ac|2|llama3_debugmodel_sdpa|--parallelism.tensor_parallel_degree 2
fsdp4|4|$LLAMA|
tp2|2|$LLAMA|--parallelism.tensor_parallel_degree 2
tp2_nosp|2|$LLAMA|--parallelism.tensor_parallel_degree 2 --parallelism.no-enable-sequence-parallel
fsdp2tp2|4|$LLAMA|--parallelism.tensor_parallel_degree 2
fsdp2tp2_nosp|4|$LLAMA|--parallelism.tensor_parallel_degree 2 --parallelism.no-enable-sequence-parallel
cp2|2|$LLAMA|--parallelism.context_parallel_degree 2|--parallelism.tensor_parallel_degree 2
cp2_nolb|2|$LLAMA|--parallelism.context_parallel_degree 2 --parallelism.context_parallel_load_balancer None|--parallelism.tensor_parallel_degree 2
fsdp2_compile|2|$LLAMA|--compile.enable
tp2_compile|2|$LLAMA|--parallelism.tensor_parallel_degree 2 --compile.enable
tp2_compile_model|2|$LLAMA|--parallelism.tensor_parallel_degree 2 --compile.enable --compile.components model
moe_ep2|2|qwen3_moe_debug_sdpa_noac|--parallelism.expert_parallel_degree 2 --training.disable_cuda_graphs
moe_ep2_4|4|qwen3_moe_debug_sdpa_noac|--parallelism.expert_parallel_degree 2 --training.disable_cuda_graphs
moe_ep1|2|qwen3_moe_debug_sdpa_noac|
fsdp2_fd|2|$LLAMA|--parallelism.spmd-backend full_dtensor
tp2_fd|2|$LLAMA|--parallelism.spmd-backend full_dtensor --parallelism.tensor_parallel_degree 2
fsdp2tp2_fd|4|$LLAMA|--parallelism.spmd-backend full_dtensor --parallelism.tensor_parallel_degree 2
"
ROWS="${ROWS:-$(echo "$MATRIX" | awk -F'|' 'NF>1{print $1}' | tr '\n' ' ') dcp}"

run_one() {  # stack row nproc config weightflag args...
    local stack=$1 row=$2 n=$3 cfg=$4 wflag=$5; shift 5
    rm -f "$OUT/$stack-$row.json"
    ( cd "$OUT" && timeout "${ROW_TIMEOUT:-900}" "$PY" -m torch.distributed.run --nproc_per_node "$n" --master_port "$(free_port)" \
        "$ROOT/scripts/torchtitan/run_titan.py" --stack "$stack" --record "$OUT/$stack-$row.json" \
        ${DUMP_GRADS:+--dump-grads "$OUT/grads-$stack-$row.pt"} ${PROFILE:+--profile "$OUT/prof-$stack-$row.pstats"} \
        "$wflag" "${WEIGHTS:-$OUT/weights-$row.pt}" -- \
        --module titan_configs --config "$cfg" --hf_assets_path "$OUT/assets/tokenizer" \
        --dataloader.dataset_path "$OUT/assets/c4_test" --training.steps "$STEPS" --training.seq_len 128 \
        --training.local_batch_size 2 --training.mixed_precision_param float32 --validator.no-enable \
        --parallelism.spmd-backend partial_dtensor --metrics.log_freq 1 --dump_folder "$OUT/dump-$stack-$row" \
        "$@" ) >"$OUT/$stack-$row.log" 2>&1
    echo "  $stack: rc $? ($OUT/$stack-$row.log)"
}

for row in $ROWS; do
    line=$(echo "$MATRIX" | awk -F'|' -v r="$row" '$1==r')
    if [ -z "$line" ]; then
        [ "$row" = dcp ] || [ "$row" = ft ] || [[ "$row" == dcpx_* ]] && continue
        echo "unknown row $row" >&2; continue
    fi
    IFS='|' read -r name n cfg args ref <<<"$line"
    echo "row $name ($n ranks): $args${ref:+ (torch: $ref)}"
    if [ "$INIT" = seed ]; then   # each stack initialises itself from SEED and writes its initial weights
        # shellcheck disable=SC2086
        run_one torch "$name" "$n" "$cfg" --save-weights --checkpoint.no-enable --debug.seed "$SEED" ${ref:-$args}
        # shellcheck disable=SC2086
        WEIGHTS="$OUT/weights-hp-$name.pt" run_one hp "$name" "$n" "$cfg" --save-weights --checkpoint.no-enable \
            --debug.seed "$SEED" $args
        continue
    fi
    # shellcheck disable=SC2086
    run_one torch "$name" "$n" "$cfg" --save-weights --checkpoint.no-enable ${ref:-$args}
    # shellcheck disable=SC2086
    run_one hp "$name" "$n" "$cfg" --load-weights --checkpoint.no-enable $args
done

# DCP across the stacks: torch trains STEPS steps saving a checkpoint at step 3; hyper_parallel resumes
# from torch's checkpoint at step 3 and runs to STEPS; its steps 4.. are compared with torch's.
if [[ " $ROWS " == *" dcp "* ]]; then
    echo "row dcp (2 ranks): torch saves at step 3, hyper_parallel resumes"
    rm -rf "$OUT/ckpt-dcp"
    run_one torch dcp 2 "$LLAMA" --save-weights --checkpoint.enable --checkpoint.folder "$OUT/ckpt-dcp" \
        --checkpoint.interval 3 --checkpoint.no-last-save-model-only
    run_one hp dcp 2 "$LLAMA" --save-weights --checkpoint.enable --checkpoint.folder "$OUT/ckpt-dcp" \
        --checkpoint.interval 1000 --checkpoint.load_step 3
fi
# DCP interchange (issue 41): ROWS="dcpx_ROW" for a matrix row ROW (e.g. dcpx_fsdp2tp2, dcpx_moe_ep2_4).
# Each stack trains CKPT_STEP steps from the same initial weights (torch writes them, hyper_parallel loads
# them) and saves a full DCP checkpoint at CKPT_STEP; then each checkpoint (step-CKPT_STEP, copied into a
# folder of its own per reader) is resumed by both stacks up to STEPS. Compared rows:
#   dcpx_ROW_w  the two writers' steps 1..CKPT_STEP (the checkpoints hold equal states)
#   dcpx_ROW_t  torch's checkpoint resumed by torch and by hyper_parallel (steps CKPT_STEP+1..STEPS)
#   dcpx_ROW_h  hyper_parallel's checkpoint resumed by torch and by hyper_parallel
CKPT_STEP="${CKPT_STEP:-3}"
CMP_ROWS=""
for row in $ROWS; do
    case "$row" in dcp) CMP_ROWS="$CMP_ROWS dcp"; continue ;; ft) continue ;; dcpx_*) ;; *) CMP_ROWS="$CMP_ROWS $row"; continue ;; esac
    base=${row#dcpx_}
    line=$(echo "$MATRIX" | awk -F'|' -v r="$base" '$1==r')
    [ -z "$line" ] && { echo "unknown row $row" >&2; continue; }
    IFS='|' read -r name n cfg args ref <<<"$line"
    echo "row $row ($n ranks): $args; each stack saves at step $CKPT_STEP, both resume each checkpoint"
    for w in torch hp; do
        [ -n "${DCPX_REUSE:-}" ] && [ -f "$OUT/ckpt-$row-$w/step-$CKPT_STEP/.metadata" ] && continue  # writers done
        rm -rf "$OUT/ckpt-$row-$w"
        [ $w = torch ] && wf=--save-weights || wf=--load-weights
        # shellcheck disable=SC2086
        WEIGHTS="$OUT/weights-$row.pt" run_one $w "${row}_w" "$n" "$cfg" $wf --checkpoint.enable \
            --checkpoint.folder "$OUT/ckpt-$row-$w" --checkpoint.interval "$CKPT_STEP" \
            --checkpoint.no-last-save-model-only $args --training.steps "$CKPT_STEP"
    done
    for w in torch hp; do
        for r in torch hp; do
            d="$OUT/ckpt-$row-$w-by-$r"
            rm -rf "$d" && mkdir -p "$d" && ln -s "$OUT/ckpt-$row-$w/step-$CKPT_STEP" "$d/" ||
                { echo "  no checkpoint $OUT/ckpt-$row-$w/step-$CKPT_STEP" >&2; continue; }
            # shellcheck disable=SC2086
            WEIGHTS=/dev/null run_one $r "${row}_${w:0:1}" "$n" "$cfg" --save-weights \
                --checkpoint.enable --checkpoint.folder "$d" --checkpoint.load_only \
                --checkpoint.no-last-save-model-only --checkpoint.load_step "$CKPT_STEP" $args
        done
    done
    CMP_ROWS="$CMP_ROWS ${row}_w ${row}_t ${row}_h"
done
# Fault tolerance (issue 40 item 5): torchtitan's own --fault_tolerance.enable (its torchft experiment,
# FaultTolerantTrainer), 2 replica groups of FSDP2 x 2 ranks, a torchft lighthouse on 127.0.0.1 and a free port.
# Per stack: group 0, group 1 and a spare for group 1 start together (the spare waits after its imports);
# every rank of group 1 SIGKILLs itself inside the backward of step FT_DIE; the spare is then let in, joins
# the quorum and heals from group 0 (torchft's live state transfer) while group 0 goes on; FT_STEPS steps,
# FT_SLEEP s pacing per step. The fixes to torchtitan's trainer (both stacks): scripts/torchtitan/titan_ft.py.
# Losses, commits, state digests and heal time per group and life: scripts/torchtitan/ft_report.py.
FT_STEPS="${FT_STEPS:-12}"; FT_DIE="${FT_DIE:-4}"; FT_SLEEP="${FT_SLEEP:-1}"
ft_group() {  # stack group life [extra run_titan args]
    local stack=$1 g=$2 life=$3; shift 3
    ( cd "$OUT" && export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" &&   # this checkout's hyper_parallel
      exec timeout "${ROW_TIMEOUT:-900}" "$PY" -m torch.distributed.run --nproc_per_node 2 \
        --master_port "$(free_port)" "$ROOT/scripts/torchtitan/run_titan.py" --stack "$stack" \
        --record "$OUT/$stack-ft-g$g-$life.json" --step-sleep "$FT_SLEEP" "$@" -- \
        --module titan_configs --config llama3_debugmodel_sdpa_noac_ft --hf_assets_path "$OUT/assets/tokenizer" \
        --dataloader.dataset_path "$OUT/assets/c4_test" --training.steps "$FT_STEPS" --training.seq_len 128 \
        --training.local_batch_size 2 --training.mixed_precision_param float32 --validator.no-enable \
        --parallelism.spmd-backend partial_dtensor --metrics.log_freq 1 --checkpoint.enable --checkpoint.interval 1000 \
        --dump_folder "$OUT/dump-$stack-ft-g$g" --fault_tolerance.enable --fault_tolerance.replica_id "$g" \
        --fault_tolerance.group_size 2 --fault_tolerance.process_group gloo --debug.seed 42 ) \
        >"$OUT/$stack-ft-g$g-$life.log" 2>&1
}
if [[ " $ROWS " == *" ft "* ]]; then
    echo "row ft (2 groups x 2 ranks): group 1 SIGKILLed in the backward of step $FT_DIE, a spare takes its place"
    for stack in ${FT_STACKS:-torch hp}; do
        port=$(free_port)
        # min_replicas 1: the survivor trains on alone; torchtitan has no guard against a restarted group forming
        # a quorum of its own (split brain), so the spare is let in only while group 0 runs, and the 10 s join
        # timeout keeps the quorum open for group 0. The wheel's console script runs under $PY (a copied
        # venv's scripts keep their old interpreter path).
        "$PY" "$VENV/bin/torchft_lighthouse" --bind "127.0.0.1:$port" --min_replicas 1 --join_timeout_ms 10000 \
            --heartbeat_timeout_ms 5000 --quorum_tick_ms 100 >"$OUT/$stack-ft-lighthouse.log" 2>&1 &
        lh=$!
        export TORCHFT_LIGHTHOUSE="http://127.0.0.1:$port"
        start="$OUT/$stack-ft-start.go" gate="$OUT/$stack-ft-spare.go"
        rm -rf "$OUT/$stack"-ft-g*.json* "$OUT/dump-$stack-ft-g"* "$start"* "$gate"*
        # both groups past their imports before either starts (else the first one forms a quorum of its own)
        ft_group "$stack" 0 1 --start-gate "$start" & g0=$!
        ft_group "$stack" 1 1 --start-gate "$start" --die-at-step "$FT_DIE" & g1=$!
        ft_group "$stack" 1 2 --start-gate "$gate" & spare=$!
        for _ in $(seq 1800); do [ "$(ls "$start".ready.* 2>/dev/null | wc -l)" -ge 4 ] && break; sleep 0.5; done
        touch "$start"
        wait $g1; echo "  $stack group 1 life 1: rc $? (killed in step $FT_DIE)"
        touch "$gate"
        wait $spare; echo "  $stack group 1 life 2 (the spare): rc $?"
        wait $g0; echo "  $stack group 0: rc $?"
        kill "$lh" 2>/dev/null; wait "$lh" 2>/dev/null
        unset TORCHFT_LIGHTHOUSE
    done
    "$PY" scripts/torchtitan/ft_report.py "$OUT" ${FT_STACKS:-torch hp}
fi
"$PY" scripts/torchtitan/compare.py ${INIT:+--init "$INIT"} "$OUT" $CMP_ROWS
