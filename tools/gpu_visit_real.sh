#!/usr/bin/env bash
# Issue 65's first visit, on a lent GPU machine once ../shared/gpu's bundle (built with MODEL=the supervised start
# in bf16) is stashed: a real model, SmolLM2-135M-Instruct's supervised start, trained by simple_grpo.train in full,
# bf16, vLLM on the same GPU, for MINUTES minutes (start-up included), evaluated greedily before and after.
#
#     python tools/provenance.py write      # first, on the machine that holds the repository: the tree's commit
#     source .gpu-carry/pN/on_gpu.sh install && MINUTES=5 bash tools/gpu_visit_real.sh      # then, on the GPU
#
# Everything it keeps goes to $OUT (the device tool's folder that comes back): the report, the trainer's
# metrics.jsonl, both evaluations' details, the logs' tails, nvidia-smi's view and provenance.json (the carried
# commit, whether the tree had changes, and its hash checked against the tree here: tools/provenance.py; it stops
# before anything runs where nothing was carried). Each command has its own timeout.
# LR (default 5e-6): full training of this model on the CPU gained +6.0 on dev at 1e-5 over 40 steps of 4 x 8
# (docs/real_model.md, the search for GRPO's settings); a visit runs many more steps of 8 x 8, so half of that.
set -u
: "${OUT:?set OUT to the folder that comes back}"
MINUTES=${MINUTES:-5}
START=/tmp/b/models/$(ls /tmp/b/models | head -1)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
TREE=$(python3 tools/provenance.py check --out "$OUT/provenance.json") || exit 2
echo "gpu_visit_real: $TREE; start $START, $MINUTES minutes of training, $(date -u)" | tee "$OUT/visit.txt"
timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/visit.txt" 2>&1
t0=$SECONDS
timeout $((MINUTES * 60 + 240)) python3 tools/gpu_real.py --start "$START" --minutes "$MINUTES" --steps 5000 \
    --lr "${LR:-5e-6}" > "$OUT/real.out" 2> "$OUT/real.log"
echo "gpu_real.py: exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/visit.txt"
tail -c 200000 "$OUT/real.log" > "$OUT/real.log.tail" && rm "$OUT/real.log"
RUNS=${SIMPLE_GRPO_RUNS:-runs}  # where the trainers put runs/RUN_NAME
cp "$RUNS/gpu_real_seed0_grpo/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null
for f in "$RUNS"/gpu_real_seed0/{report.json,eval_start.jsonl,eval_after.jsonl}; do
    cp "$f" "$OUT/" 2>/dev/null
done
tail -30 "$OUT/real.out"
