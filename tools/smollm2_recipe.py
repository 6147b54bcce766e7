"""The settings that make SmolLM2-135M-Instruct learn the toy task on a 2-core CPU: what `make demo-real`
(tools/demo_real.py) runs, and what bench/compare_trl.py --world smollm2 gives TRL and our trainers alike.
docs/real_model.md has the search behind each value and what it changed."""

# A short system prompt: the model pays for every prompt token in each forward pass, and R1-Zero's
# (135 tokens with a question, against 81 with this one) made the warm start's steps ~1.5x slower for a
# model that learns the format from the warm start anyway.
SYSTEM_PROMPT = ("Solve the math problem. Think step by step inside <think> </think>, then write only the "
                 "final number inside <answer> </answer>.")

# The supervised start ("before", tools/warm_start.py): batches of 8 of the training problems' worked solutions,
# all in the <think>/<answer> format, trained until dev accuracy (200 dev problems, greedy, every 20 steps)
# has not risen for 4 evaluations; the checkpoint with the best dev accuracy is kept. Chosen on dev accuracy
# alone (docs/real_model.md, "The supervised curve").
SUPERVISED_FLAGS = ["--batch_size", "8", "--lr", "5e-5", "--in_format_share", "1.0"]
WARM_START_FLAGS = [*SUPERVISED_FLAGS, "--steps", "400", "--eval_every", "20", "--patience", "4"]
# The control beside GRPO: the same supervised training continued from "before" (tools/demo_real.py adds --steps
# and its own seed).
CONTROL_FLAGS = SUPERVISED_FLAGS

# GRPO: 4 problems x 8 completions a step; completions of the warm-started model are ~18 tokens (none cut at
# 64). LoRA on every linear layer at lr 2e-4 (the tiny model's LoRA took 3e-4; 1e-5 moved SmolLM2's adapters
# by a KL of 8e-6 in 8 steps), beta 0: no reference pass at all.
PROMPTS, GROUP, MAX_NEW_TOKENS = 4, 8, 64
LR, BETA = 2e-4, 0.0
LORA_TARGETS = "all-linear"  # with the trainers' LoRA defaults: r 16, alpha 32, dropout 0.05 (TRL's)
SAMPLING_FLAGS = ["--num_generations", str(GROUP), "--max_new_tokens", str(MAX_NEW_TOKENS)]
# The trainer takes both cores (--threads 2; vLLM's worker keeps the second): it computes ~7.6 s of an 8 s step
# while the worker samples for ~3.3 s, and with 2 threads a step took 7.2 s instead of 8.0, same numbers.
TRAINER_THREADS = ["--threads", "2"]
# vLLM's context: the training prompts are 64-103 tokens with SYSTEM_PROMPT, so 168 holds each one and 64 new tokens
MAX_MODEL_LEN = 168
TRAIN_FLAGS = ["--use_peft", "--lora_target_modules", LORA_TARGETS, "--lr", str(LR), "--beta", str(BETA),
               "--batch_prompts", str(PROMPTS), *SAMPLING_FLAGS, "--max_model_len", str(MAX_MODEL_LEN),
               *TRAINER_THREADS]
STEPS = 40
# The control's budget, fixed in steps so the same command trains the same control on any day and under any load:
# the supervised steps one GRPO step costs. Measured on the 2-core machine alone, in the same runs (make demo-real
# SEED=1 and SEED=2, docs/real_model.md): GRPO's 40 steps took 6.0 minutes, start-up included, and the control,
# timed on the same minutes then (--max_minutes), made 60 steps. The control trains round(GRPO's steps x this).
CONTROL_STEPS_PER_GRPO_STEP = 1.5

# Greedy evaluation: room for the untouched model's long answers (~84-150 tokens) too.
EVAL_FLAGS = ["--max_new_tokens", "128"]

# Setting (b) of make demo-real --setting answers (issue 43): worked solutions for a few problems, final answers
# for the rest, as most math and code RL data comes. A few hundred worked solutions is what one person writes
# in a day; the other 19,700 training problems keep their final answer only ("#### N").
FEW_SOLUTIONS = 300
TRAIN = "data/toy_math/train.jsonl"  # the training problems: the start's (tools/warm_start.py's default --train)
# The start: supervised on those few at the recipe's batch and lr, falling linearly to 0 over 150 steps (4
# epochs of the 300), dev accuracy every 50 steps, the best kept.
FEW_START_FLAGS = [*SUPERVISED_FLAGS, "--train_n", str(FEW_SOLUTIONS), "--lr_schedule", "linear", "--steps", "150",
                   "--eval_every", "50"]


def write_answers_only(path):
    """TRAIN's problems after the first FEW_SOLUTIONS, each with its final answer only ("#### N", no worked
    solution), to the .jsonl file at path: what GRPO and RAFT are given in setting (b). Returns how many."""
    import json
    import os
    from simple_grpo.task.problems import load_jsonl
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
    answers_only = load_jsonl(os.path.join(root, TRAIN))[FEW_SOLUTIONS:]
    with open(path, "w") as f:
        for p in answers_only:
            f.write(json.dumps({"question": p["question"], "answer": "#### " + p["answer"].split("####")[-1].strip()})
                    + "\n")
    return len(answers_only)
