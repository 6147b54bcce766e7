#!/usr/bin/env bash
# Issue 65's second visit, on a lent GPU machine once ../shared/gpu's FLASHINFER=1 bundle is installed: the fixes
# at scale with bench/gpu_scale.py (random weights), one device command per part, each under its own timeout.
#
#     python tools/provenance.py write     # first, on the machine that holds the repository: the tree's commit
#     source .gpu-carry/pN/on_gpu.sh install; bash tools/gpu_visit_scale.sh 7b SECONDS     # first call, on the GPU
#     bash tools/gpu_visit_scale.sh 0.5b SECONDS                                           # next call, warm
#
# 7b: Qwen2.5-7B-shaped, all-linear LoRA, --gradient_checkpointing, vLLM's V1 runner (as the run of 2026-11-27
# before the stop-set fix): the sampler gap's max and the GPU peak against the plan. 0.5b: Qwen2.5-0.5B-shaped, full,
# on vLLM's V2 runner (vLLM 0.26's default on CUDA), to its last step. Three steps each; the bench sets
# --time_phases. Everything kept goes to $OUT: the bench's output and JSON line, its log's tail, the trainer's
# metrics.jsonl, nvidia-smi's view, and NAME.provenance.json (the carried commit, changes and tree hash, checked
# here by tools/provenance.py; it stops before anything runs where nothing was carried).
set -u
: "${OUT:?set OUT to the folder that comes back}"
NAME=${1:?usage: gpu_visit_scale.sh 7b|0.5b SECONDS}
SECONDS_LIMIT=${2:?usage: gpu_visit_scale.sh 7b|0.5b SECONDS}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
case $NAME in
    7b) export VLLM_USE_V2_MODEL_RUNNER=0
        ARGS=(--config configs/qwen2.5-7b --lora --steps 3 -- --gradient_checkpointing) ;;
    0.5b) unset VLLM_USE_V2_MODEL_RUNNER
        ARGS=(--config configs/qwen2.5-0.5b --steps 3) ;;
    *) echo "unknown part $NAME: use 7b or 0.5b" >&2; exit 2 ;;
esac
TREE=$(python3 tools/provenance.py check --out "$OUT/$NAME.provenance.json") || exit 2
echo "gpu_visit_scale $NAME: $TREE; VLLM_USE_V2_MODEL_RUNNER=${VLLM_USE_V2_MODEL_RUNNER:-unset}, $(date -u)" \
    | tee "$OUT/$NAME.visit.txt"
timeout 20 nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv >> "$OUT/$NAME.visit.txt" 2>&1
t0=$SECONDS
timeout "$SECONDS_LIMIT" python3 bench/gpu_scale.py "${ARGS[@]}" > "$OUT/$NAME.out" 2> "$OUT/$NAME.log"
echo "bench/gpu_scale.py $NAME: exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/$NAME.visit.txt"
tail -c 300000 "$OUT/$NAME.log" > "$OUT/$NAME.log.tail" && rm "$OUT/$NAME.log"
cp "${SIMPLE_GRPO_RUNS:-runs}/bench_gpu_scale/metrics.jsonl" "$OUT/$NAME.metrics.jsonl" 2>/dev/null
tail -c 3000 "$OUT/$NAME.out"
