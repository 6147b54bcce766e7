#!/usr/bin/env bash
# R1-Zero-style GRPO on GSM8K: a Qwen2.5 base model learns to think, then answer.
#
#   bash recipes/gsm8k.sh                                   # Qwen2.5-0.5B on 3 GPUs (ref, vLLM, trainer)
#   MODEL=Qwen/Qwen2.5-3B LR=1e-6 bash recipes/gsm8k.sh
#   MODEL=models/tiny-math DATASET=data/toy_math/train.jsonl EVAL_DATASET=data/toy_math/test.jsonl \
#       REF_DEVICE=cpu STEPS=2 bash recipes/gsm8k.sh      # the same commands on CPU (a test does this:
#   tests/test_trainer_options.py::test_the_gsm8k_recipe_runs_two_steps_on_cpu_with_the_tiny_model)
#
# GPU 0: the reference server (python ref_server.py); GPU 1: vLLM, which generates while
# GPU 2 trains with DeepSpeed ZeRO-2 (deepspeed --module simple_grpo.train); then evaluate.py on the test split.
# Every variable below can be set from the environment; docs/guide.md, "The GSM8K recipe (GPU)", explains them.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-Qwen/Qwen2.5-0.5B}
DATASET=${DATASET:-openai/gsm8k}
DATASET_CONFIG=${DATASET_CONFIG-main}  # "" for a local file
EVAL_DATASET=${EVAL_DATASET:-$DATASET}
RUN=${RUN:-gsm8k}
STEPS=${STEPS:-500}
LR=${LR:-1e-6}
BATCH_PROMPTS=${BATCH_PROMPTS:-8}  # questions per step
NUM_GENERATIONS=${NUM_GENERATIONS:-8}  # answers per question: 64 completions per step
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-700}
MICRO_BATCH_GROUPS=${MICRO_BATCH_GROUPS:-1}  # groups per forward/backward: bounds activation memory
TEMPERATURE=${TEMPERATURE:-0.9}
BETA=${BETA:-0.04}
DTYPE=${DTYPE:-bfloat16}  # the trainer, vLLM and (unless REF_DTYPE says otherwise) the ref server
SAVE_EVERY=${SAVE_EVERY:-100}
REF_DEVICE=${REF_DEVICE:-cuda:0}
GEN_DEVICE=${GEN_DEVICE:-1}
TRAIN_GPU=${TRAIN_GPU:-2}
PORT=${PORT:-59875}
# the project's venv (make install) when there is one, else what PATH finds
if [ -x .venv/bin/python ]; then VENV_BIN=.venv/bin/; else VENV_BIN=; fi
PY=${PY:-${VENV_BIN}python}
DEEPSPEED=${DEEPSPEED:-${VENV_BIN}deepspeed}

# 1. the frozen reference model, in the background; stopped when this script ends
$PY ref_server.py --model "$MODEL" --device "$REF_DEVICE" --dtype "${REF_DTYPE:-$DTYPE}" --port "$PORT" &
REF_PID=$!
trap 'kill $REF_PID 2>/dev/null; wait $REF_PID 2>/dev/null || true' EXIT
# wait for its /health, at most 10 minutes (a 7B model loads slowly), and stop at once if it died
$PY -c "import os, sys, time, requests
for _ in range(600):
    try:
        os.kill($REF_PID, 0)
    except OSError: sys.exit('ref_server.py (pid $REF_PID) exited during start-up: see its messages above')
    try:
        requests.get('http://127.0.0.1:$PORT/health', timeout=1).raise_for_status(); sys.exit(0)
    except requests.RequestException: time.sleep(1)
sys.exit('ref_server.py did not answer /health in 10 minutes')"

# 2. GRPO: vLLM on GEN_DEVICE samples while DeepSpeed trains on TRAIN_GPU
data_flags=(--dataset "$DATASET" --dataset_config "$DATASET_CONFIG" --split train)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    launch=($DEEPSPEED --include "localhost:$TRAIN_GPU")
    gen_flags=(--gen_device "$GEN_DEVICE")
else
    launch=($DEEPSPEED --num_gpus 1)  # CPU: one rank
    gen_flags=()  # vLLM on CPU cores (--gen_device is refused where there is no GPU)
fi
"${launch[@]}" --module simple_grpo.train --model "$MODEL" "${data_flags[@]}" --run_name "$RUN" \
    --ref_url "http://127.0.0.1:$PORT" "${gen_flags[@]}" --zero_stage 2 \
    --steps "$STEPS" --lr "$LR" --batch_prompts "$BATCH_PROMPTS" --num_generations "$NUM_GENERATIONS" \
    --max_new_tokens "$MAX_NEW_TOKENS" --temperature "$TEMPERATURE" --beta "$BETA" \
    --micro_batch_groups "$MICRO_BATCH_GROUPS" --dtype "$DTYPE" \
    --max_model_len "${MAX_MODEL_LEN:-$((MAX_NEW_TOKENS + 512))}" --save_every "$SAVE_EVERY" ${EXTRA_FLAGS:-}

# 3. accuracy on the test split, greedy (evaluate.py; vLLM when installed)
$PY evaluate.py --model "${SIMPLE_GRPO_RUNS:-runs}/$RUN/step_$STEPS" --dataset "$EVAL_DATASET" \
    --dataset_config "$DATASET_CONFIG" --split test --max_new_tokens "$MAX_NEW_TOKENS" --dtype "$DTYPE" --json
