#!/usr/bin/env bash
# bench/gpu_targets.sh: issue 59's targets measured with bench/gpu_scale.py on one H100 or H200, random weights.
#
#     bash bench/gpu_targets.sh OUT_DIR [3b-700 3b-300 7b-700]     # no names: all three, in this order
#
# Before a visit, where the repository is: python tools/provenance.py write (the tree's commit, carried with it);
# OUT_DIR/provenance.json then records it, checked against the tree that runs (it stops where nothing was carried).
#
# 3b-700, 3b-300: Qwen2.5-3B-shaped, full, bf16 ZeRO-2, --offload_optimizer --gradient_checkpointing, at 700 and at
# 300 completion tokens (300 stands for a trained model's shorter GSM8K answers); 7b-700: Qwen2.5-7B-shaped, LoRA,
# --gradient_checkpointing, at 700. Each writes OUT_DIR/NAME.json (the bench's JSON line: the step, its split,
# MFU and HFU, the update's phases, memory beside the plan) and OUT_DIR/NAME.log, under a timeout of its own.
# Three steps each: the first (vLLM's and the allocator's warm-up) is left out of the medians, and on CUDA the last
# is profiled for the GPU's idle seconds and left out too, so the medians are step 2's. Time: the 3B run of
# 2026-11-26 took 293 s with its model cached (start-up, three ~15 s steps, the final save of weights and
# optimizer state), so the three together take ~15 minutes, past one device command's 10: give each name a
# command of its own (3b-700 first). The targets: 3B one step <= 8 s at 700 tokens and MFU >= 25%; 7B LoRA one
# step <= 10 s at 700.
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash bench/gpu_targets.sh OUT_DIR [3b-700 3b-300 7b-700]}
shift
mkdir -p "$OUT"
PY=${PY:-python3}
"$PY" tools/provenance.py check --out "$OUT/provenance.json" || exit 2
THREE_B=(--config configs/qwen2.5-3b --steps 3)
THREE_B_FLAGS=(-- --offload_optimizer --gradient_checkpointing)
SEVEN_B=(--config configs/qwen2.5-7b --lora --steps 3)
SEVEN_B_FLAGS=(-- --gradient_checkpointing)

run() {  # NAME SECONDS ARGS...: one bench under a timeout; its last line is its JSON
    local name=$1 seconds=$2
    shift 2
    local t0=$SECONDS
    timeout "$seconds" "$PY" bench/gpu_scale.py "$@" > "$OUT/$name.out" 2> "$OUT/$name.log"
    local rc=$?
    tail -1 "$OUT/$name.out" > "$OUT/$name.json"
    echo "$name: exit $rc in $((SECONDS - t0)) s: $(cat "$OUT/$name.json")"
}

for name in "${@:-3b-700 3b-300 7b-700}"; do
    for one in $name; do
        case $one in
            3b-700) run 3b-700 420 "${THREE_B[@]}" --max_new_tokens 700 "${THREE_B_FLAGS[@]}" ;;
            3b-300) run 3b-300 360 "${THREE_B[@]}" --max_new_tokens 300 "${THREE_B_FLAGS[@]}" ;;
            7b-700) run 7b-700 540 "${SEVEN_B[@]}" --max_new_tokens 700 "${SEVEN_B_FLAGS[@]}" ;;
            *) echo "unknown target $one: use 3b-700, 3b-300 or 7b-700" >&2; exit 2 ;;
        esac
    done
done
