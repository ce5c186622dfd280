#!/usr/bin/env bash
# The checks only a GPU machine can make, in one call of under 10 minutes on one GPU:
#   1. the GPU tests the suite skips on CPU (vLLM rollout backend + weight sync, router replay
#      against vLLM's routed experts, DeepSpeed ZeRO++ quantised weights/gradients);
#   2. a bf16 DeepSpeed ZeRO-2 train run on CUDA (NCCL, world of one) and its steps/s;
#   3. the same run with router replay (the hf backend records routes on the GPU);
#   4. expert parallelism, 4-bit gradient compression and the MoE benchmarks' figures;
#   5. the trainer with expert parallelism (moe.expert_parallel = 2, ZeRO-2, NCCL) against
#      EP = 1, where two GPUs are visible (NCCL cannot put two ranks on one GPU).
# Every check prints `gpu_check <name>: ok|failed|skipped ...` and its figures in the
# benchmarks' line format; the script exits non-zero if any check failed. On a machine without a
# CUDA GPU it says so and exits 0 (nothing here can run).
#
#   bash scripts/gpu_check.sh            # from the repository root, with .venv built
#   GPU_CHECK_BUDGET_S=540 GPU_CHECK_OUT=/tmp/gc PY=python3 bash scripts/gpu_check.sh
#
# A GPU machine without a package index: scripts/gpu_wheels.sh says what to carry there.
# Logs, run folders and metrics go under GPU_CHECK_OUT (default var/gpu_check; relative to the
# repository root unless absolute). Not $OUT: a lent GPU machine sets that to its return folder.
set -uo pipefail

cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
BUDGET=${GPU_CHECK_BUDGET_S:-540}
START=$(date +%s)
OUT=${GPU_CHECK_OUT:-var/gpu_check}
[[ $OUT = /* ]] || OUT=$PWD/$OUT
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} CRUCIBLE_THREADS=${CRUCIBLE_THREADS:-4}
export CRUCIBLE_VAR_DIR=${CRUCIBLE_VAR_DIR:-$OUT/var}

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: needs a CUDA GPU; this machine has none (torch.cuda.is_available() is False)."
    echo "gpu_check: nothing to check here; the CPU suite (make test) covers the rest."
    exit 0
fi
"$PY" - <<'EOF'
import torch
try:
    import vllm
    v = vllm.__version__
except ImportError:
    v = "not installed (pip install -e '.[gpu]')"
print(f"gpu_check: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, "
      f"torch {torch.__version__}, CUDA {torch.version.cuda}, vLLM {v}")
EOF

FAILED=0
left() { echo $(( BUDGET - ($(date +%s) - START) )); }

# check NAME SECONDS CMD...: run CMD with a time limit, log to $OUT/NAME.log, print its
# benchmark lines and a verdict.
check() {
    local name=$1 limit=$2; shift 2
    local budget; budget=$(left)
    if (( budget < 20 )); then
        echo "gpu_check $name: skipped (the ${BUDGET}s budget is spent)"; return
    fi
    (( limit > budget )) && limit=$budget
    local t0=$(date +%s)
    timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$? took=$(( $(date +%s) - t0 ))
    grep -E '^[a-z0-9_]+: crucible=|passed|failed|skipped|SKIPPED|Error' "$OUT/$name.log" \
        | grep -v '^\s*$' | tail -n 12 | sed "s/^/  /"
    if (( rc == 0 )); then
        echo "gpu_check $name: ok (${took}s)"
    elif (( rc == 124 || rc == 137 )); then
        echo "gpu_check $name: failed (timed out after ${limit}s; log $OUT/$name.log)"; FAILED=1
    else
        echo "gpu_check $name: failed (exit $rc; log $OUT/$name.log)"; FAILED=1
    fi
}

# 1. The GPU tests (they skip on CPU with their reasons; -rs prints any skip reason here too).
check gpu-tests 300 "$PY" -m pytest -q -rs -p no:cacheprovider -p no:django \
    tests/workers/rl/test_vllm_rollout.py tests/workers/rl/test_router_replay.py \
    tests/workers/rl/test_grad_compress.py

# 2./3. bf16 DeepSpeed on CUDA, without and with router replay.
train_config() {  # $1 run dir, $2 router_replay true|false
    cat >"$1/run.toml" <<EOF
name = "gpu-check"
[model]
seed = 3
[model.preset]
num_layers = 4
num_experts = 8
hidden_size = 128
moe_intermediate_size = 64
[rollout]
group_size = 8
max_new_tokens = 24
[trainer]
steps = 30
prompts_per_step = 8
micro_batch_size = 16
zero_stage = 2
precision = "bf16"
seed = 7
[moe]
router_replay = $2
[checkpoint]
dir = "$1/ckpt"
every = 0
[output]
metrics_jsonl = "$1/metrics.jsonl"
stdout = false
EOF
}
steps_per_s() {  # the run's figures from its metrics file, as benchmark lines
    "$PY" - "$1" "$2" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
steps = [r for r in rows if r.get("kind") == "metrics" and "loss" in r.get("metrics", {})]
name = sys.argv[2]
if len(steps) > 4:  # wall time between step records, past the first (compile, warm-up) steps
    times = [b["time"] - a["time"] for a, b in zip(steps[2:], steps[3:])]
    print(f"{name}_steps_per_s: crucible={1 / statistics.median(times):.2f}")
for key in ("gen_tokens_per_s", "train_tokens_per_s"):
    values = [r["metrics"][key] for r in steps[2:] if key in r["metrics"]]
    if values:
        print(f"{name}_{key}: crucible={statistics.median(values):.0f}")
agree = [v for r in steps for k, v in r["metrics"].items()
         if k.startswith("mismatch/expert_agreement")]
if agree:
    print(f"{name}_expert_agreement_min: crucible={min(agree):.4f}")
EOF
}
for replay in false true; do
    name=bf16-deepspeed$([ $replay = true ] && echo -replay)
    dir="$OUT/$name"; rm -rf "$dir"; mkdir -p "$dir"; train_config "$dir" $replay
    check "$name" 180 "$PY" -m workers.rl train --config "$dir/run.toml"
    [ -f "$dir/metrics.jsonl" ] && steps_per_s "$dir/metrics.jsonl" "gpu_${name//-/_}"
done

# 4. Expert parallelism and 4-bit gradient compression figures (these run their ranks on the
#    host's gloo; on one GPU they show the code path, not the interconnect).
check bench-moe-ep 150 "$PY" -m tests.benchmarks.bench_moe_ep
check bench-grad-compress 200 "$PY" -m tests.benchmarks.bench_grad_compress

# 5. Expert parallelism inside the trainer, on NCCL. NCCL refuses two ranks on one device
#    ("Duplicate GPU detected"), and EP over one rank is no EP, so this needs two GPUs; on one
#    it is skipped with that reason (the CPU suite runs the same trainer path on 2 gloo ranks:
#    tests/workers/rl/test_ep_trainer.py).
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if (( GPUS >= 2 )); then
    check ep-train 240 "$PY" -m tests.benchmarks.bench_moe_ep --trainer --nproc 2 \
        --hidden 128 --trainer-steps 12 --prefix gpu_
else
    echo "gpu_check ep-train: skipped (NCCL needs one GPU per rank; this host has $GPUS, and" \
         "two processes on one GPU are refused by NCCL)"
fi

echo "gpu_check: done in $(( $(date +%s) - START ))s; logs in $OUT/"
exit $FAILED
