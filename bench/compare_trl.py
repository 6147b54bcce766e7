"""bench/compare_trl.py: TRL's GRPOTrainer against the lessons (grpo_train.py, grpo_vllm_one.py) and the full trainer
(simple_grpo/train.py), same work, on CPU.

    bash tools/install.sh requirements-bench.txt   # TRL, for this benchmark only (make bench-trl does both)
    python bench/compare_trl.py [--steps 30] [--skip 3] [--lengths 32,256] \\
        [--systems trl,grpo_train,grpo_vllm_one,full] [--gen_workers 1,2] [--lags 1,2,4] [--gen_compile on] \
        > compare_trl.jsonl
    python bench/compare_trl.py --world smollm2 --steps 20 --skip 3 --lengths 64 --systems trl,full
    python bench/compare_trl.py --world smollm2 --start DIR --steps 20 --skip 3 --lengths 64 --systems trl,full

--world smollm2 gives every system make demo-real's warm-started SmolLM2-135M-Instruct and its recipe
instead (world_settings below); what follows describes the tiny world. --start DIR gives every system the
model in DIR (a whole HF model directory: config.json and a tokenizer) in place of the world's own start,
with the world's recipe otherwise; each result line then names it ("start").

Every system trains the tiny default model (models/tiny-math) on data/toy_math/train.jsonl
with the same GRPO step: 8 prompts x 8 completions (64 completions, one optimizer step),
lr 1e-4 (constant, AdamW betas 0.9/0.99, no weight decay, gradient clipping 1.0), k3 KL
beta 0.04 to the frozen starting model, sampling temperature 0.7 (no top-k/top-p), the
'grpo' loss with group-scaled advantages, reward = correctness + 0.5 * format (simple_grpo/task/rewards.py),
seed 0 (--seed). Every completion is exactly L tokens long (EOS is suppressed until then: our
--min_new_tokens, TRL's generation_kwargs min_new_tokens), so the systems do the same
amount of sampling and training per step whatever the model would write.

Each system runs in its fastest configuration for this CPU:
  trl            GRPOTrainer in a fresh process: use_cpu, fp32 (bf16 is 2x slower on CPU),
                 transformers generate with the KV cache (no vLLM), the reference model in the
                 same process, 2 torch threads, one micro-batch of 64 per step,
                 gradient checkpointing off (--trl_gradient_checkpointing; TRL's default is on)
  grpo_train     its defaults (2 threads), with its reference server (bench/harness.py)
  full           (python -m simple_grpo.train; grpo_vllm_one: the lesson script, the same but --gen_workers)
                 its defaults (1 trainer thread, each vLLM worker on a core of its own) and
                 --gen_compile (vLLM's model compiled: ~25 s more start-up, excluded, for 10-20% faster
                 sampling; --gen_compile off: eager), with its reference server; --gen_workers 1,2 runs it
                 once per worker count (2: a second worker on the trainer's core), reported as
                 full and full_k2; --lags 1,2,4 runs it once per --max_policy_lag too (at 2 and above
                 each worker samples up to that many batches in one vLLM call), reported as full_lag1,
                 full_lag2, full_k2_lag4, ...
All run with OMP_WAIT_POLICY=PASSIVE (as tools/demo.py): with the default, spinning OpenMP threads
made TRL's generate ~10x slower whenever anything else ran on the 2 cores. Gradient checkpointing
costs TRL ~15-40% more CPU time per forward/backward of this model, with no memory it needs to save.
Differences that stay: our trainers drop groups whose 8 rewards are all equal before the
reference log-probs and the update (TRL trains on every group; such a group adds only its KL
term there); full samples the next batch while the trainer steps, with weights one
step old; TRL computes the reference log-probs in its own process, ours in the reference server.

Prints one JSON line per system and length, on stdout (all logs go to stderr):
  completions_per_s  completions trained per second of the training steps (start-up excluded,
                     the first --skip steps too): steps * 64 / their total wall time
  s_per_step         median wall time of one optimizer step (the same steps)
  peak_rss_mb        peak resident memory of everything the system runs: TRL's process (the
                     reference model is in it); our trainer, its vLLM worker and its reference
                     server, sampled together (peak_rss_trainer_mb: without the server)
  accuracy_after     greedy test accuracy of the final model (tools/launch.py's evaluate -> evaluate.py)
  completion_len_mean  mean completion length in tokens (should be L)
  policy_lag_mean, policy_lag_max  (the vLLM trainers) the policy lag of the batches the timed steps trained on
then one line per length with the ratios of our completions_per_s to TRL's; at the end, on stderr, the same
figures as a markdown table (`table`).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.harness import (BETA, GROUP, LR, PROMPTS, REWARD_WEIGHTS, TEMPERATURE, TRAIN,  # noqa: E402
                           build_deepspeed_ops, run, wait_peak_rss)
from simple_grpo.lora import is_adapter_dir  # noqa: E402
from tools import smollm2_recipe  # noqa: E402
from tools.launch import MODEL, child_env, evaluate, smollm2_warm_start  # noqa: E402
from simple_grpo.task.problems import SYSTEM_PROMPT  # noqa: E402

SYSTEMS = ("trl", "grpo_train", "full", "grpo_vllm_one")  # ours: tools/launch.py's TRAINER_ARGS
VLLM_TRAINERS = ("full", "grpo_vllm_one")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")  # any one makes a tokenizer


def check_start(model_dir):
    """--start: a whole HF model directory, which every system loads; the error names what it lacks."""
    if not os.path.isdir(model_dir):
        raise SystemExit(f"--start {model_dir}: no such directory")
    missing = []
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        lora = is_adapter_dir(model_dir)
        missing.append("config.json" + (f" (it holds LoRA adapters: `python tools/merge_lora.py {model_dir}` "
                                        "merges them into a whole model)" if lora else ""))
    if not any(os.path.isfile(os.path.join(model_dir, name)) for name in TOKENIZER_FILES):
        missing.append(f"a tokenizer (one of {', '.join(TOKENIZER_FILES)})")
    if missing:
        raise SystemExit(f"--start {model_dir} is not a model to start from: it lacks {' and '.join(missing)}; "
                         "save one with model.save_pretrained(DIR) and tokenizer.save_pretrained(DIR)")


def world_settings(world, env, start=None):
    """The work every system gets in a world. tiny: the tiny default model, full training, the settings
    above, completions of exactly L tokens. smollm2: make demo-real's warm-started SmolLM2-135M-Instruct
    and its recipe (tools/smollm2_recipe.py): its short system prompt, 4 prompts x 8, LoRA r 16
    alpha 32 dropout 0.05 on every linear layer, lr 2e-4, beta 0 (no reference model anywhere), and
    completions that end at EOS, at most L tokens, as in training (forced to L they would run on past
    the answer and score nothing). start: a model directory every system starts from in place of the world's
    own (the tiny model, or the warm start, which is then neither fetched nor trained)."""
    if start is not None:
        check_start(start)
    if world == "tiny":
        return {"model": start or MODEL, "system_prompt": SYSTEM_PROMPT, "prompts": PROMPTS, "lr": LR, "beta": BETA,
                "lora": False, "fixed_length": True, "eval_args": [], "ours": []}
    warm = start or smollm2_warm_start(env)[1]
    recipe = smollm2_recipe
    return {"model": warm, "system_prompt": recipe.SYSTEM_PROMPT, "prompts": recipe.PROMPTS, "lr": recipe.LR,
            "beta": recipe.BETA, "lora": True, "fixed_length": False,
            "eval_args": ["--system_prompt", recipe.SYSTEM_PROMPT, *recipe.EVAL_FLAGS], "ours": recipe.TRAINER_THREADS}


# ---------------------------------------------------------------------------- TRL (child process)
def trl_train(completion_len, steps, out_dir, gradient_checkpointing, seed, w):
    """Train with TRL's GRPOTrainer; one line per step in OUT_DIR/metrics.jsonl, model in OUT_DIR/final.
    w: world_settings."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from simple_grpo.task.problems import load_jsonl
    from simple_grpo.task.rewards import score, true_answer

    torch.set_num_threads(2)
    os.makedirs(out_dir, exist_ok=True)
    problems = load_jsonl(TRAIN)
    dataset = Dataset.from_list([{"prompt": [{"role": "system", "content": w["system_prompt"]},
                                             {"role": "user", "content": p["question"]}],
                                  "answer": p["answer"]} for p in problems])

    def correctness_and_format(completions, answer, **kwargs):
        # conversational prompts: each completion is [{"role": "assistant", "content": text}]
        return [score(c[0]["content"], true_answer(a), REWARD_WEIGHTS)["reward"]
                for c, a in zip(completions, answer)]

    class StepTimer(TrainerCallback):
        """Wall time between optimizer step ends (the first from the start of training)."""

        def __init__(self, path):
            self.path, self.last, self.step_s = path, None, None
            open(path, "w").close()

        def on_train_begin(self, args, state, control, **kwargs):
            self.last = time.time()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.time()
            self.step_s, self.last = now - self.last, now

        def on_log(self, args, state, control, logs=None, **kwargs):  # after on_step_end, every step
            if logs and "completions/mean_length" in logs:
                record = {"step": state.global_step, "step_s": self.step_s,
                          "completion_len": logs["completions/mean_length"], "reward_mean": logs.get("reward"),
                          "kl": logs.get("kl")}
                with open(self.path, "a") as f:
                    f.write(json.dumps(record) + "\n")

    config = GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, use_vllm=False, seed=seed,
        model_init_kwargs={"dtype": "float32"},
        # one optimizer step = one generation batch = prompts x 8 completions, in one micro-batch
        per_device_train_batch_size=w["prompts"] * GROUP, gradient_accumulation_steps=1,
        num_generations=GROUP, num_iterations=1, max_completion_length=completion_len,
        generation_kwargs={"min_new_tokens": completion_len} if w["fixed_length"] else {},
        temperature=TEMPERATURE, top_p=1.0, top_k=0,
        beta=w["beta"], loss_type="grpo", scale_rewards="group",  # TRL's default loss is dapo; ours is grpo
        learning_rate=w["lr"], lr_scheduler_type="constant", weight_decay=0.0, adam_beta2=0.99, max_grad_norm=1.0,
        gradient_checkpointing=gradient_checkpointing,
        max_steps=steps, logging_steps=1, save_strategy="no", report_to="none")
    peft_config = None
    if w["lora"]:  # our trainers' LoRA defaults, which are TRL's ModelConfig's
        from peft import LoraConfig
        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=smollm2_recipe.LORA_TARGETS,
                                 task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=w["model"], reward_funcs=correctness_and_format, args=config, train_dataset=dataset,
                          callbacks=[StepTimer(os.path.join(out_dir, "metrics.jsonl"))], peft_config=peft_config)
    trainer.train()
    trainer.save_model(os.path.join(out_dir, "final"))  # with the tokenizer


def run_trl(completion_len, steps, skip, env, gradient_checkpointing, seed, world, w, start=None):
    """TRL in a fresh process, its peak RSS sampled like our trainers' (bench/harness.py); then evaluated.
    start: --start, which the process's world_settings gets too."""
    out_dir = os.path.join("runs", f"bench_trl_{'' if world == 'tiny' else world + '_'}L{completion_len}"
                           + (f"_seed{seed}" if seed else ""))
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--trl_child", str(completion_len),
                             "--steps", str(steps), "--out_dir", out_dir,
                             "--trl_gradient_checkpointing", gradient_checkpointing, "--seed", str(seed),
                             "--world", world, *(["--start", start] if start else [])],
                            cwd=ROOT, env=env)
    peak, _ = wait_peak_rss(proc)
    if proc.returncode != 0:
        raise SystemExit(f"TRL run (L={completion_len}) failed with exit code {proc.returncode}")
    print(f"trl: {steps} steps in {time.time() - t0:.0f} s with start-up", file=sys.stderr)
    rows = [json.loads(line) for line in open(os.path.join(ROOT, out_dir, "metrics.jsonl"))]
    if len(rows) != steps:
        raise SystemExit(f"TRL logged {len(rows)} steps, expected {steps}: see {out_dir}/metrics.jsonl")
    timed = rows[skip:]
    after = evaluate(os.path.join(out_dir, "final"), env, args=w["eval_args"])
    return {"completions_per_s": round(len(timed) * w["prompts"] * GROUP / sum(r["step_s"] for r in timed), 2),
            "s_per_step": round(statistics.median(r["step_s"] for r in timed), 3),
            "peak_rss_mb": round(peak / 2**20),
            "completion_len_mean": round(statistics.mean(r["completion_len"] for r in timed), 1),
            "accuracy_after": after["accuracy"], "gradient_checkpointing": gradient_checkpointing == "on"}


# ---------------------------------------------------------------------------- our trainers
def run_ours(trainer, completion_len, steps, skip, env, seed, world, w, gen_workers=1, gen_compile=True, extra=(),
             lag=None):
    """One of our trainers' runs; lag: the full trainer's --max_policy_lag (None: its default, not passed)."""
    lesson = trainer in ("grpo_vllm_one", "grpo_train")  # the default step's flags only: its prompt, eager vLLM
    if lesson and (w["lora"] or w["system_prompt"] != SYSTEM_PROMPT):
        raise SystemExit(f"the lesson ({trainer}) has no LoRA and no --system_prompt: this world is the full "
                         "trainer's (--systems trl,full)")
    flags = ([] if lesson else ["--system_prompt", w["system_prompt"]])
    flags += ["--model", w["model"], "--batch_prompts", str(w["prompts"]),
             "--num_generations", str(GROUP), "--lr", str(w["lr"]), "--beta", str(w["beta"]),
             "--temperature", str(TEMPERATURE), "--seed", str(seed), "--max_new_tokens", str(completion_len)]
    flags += ["--min_new_tokens", str(completion_len)] if w["fixed_length"] else []
    flags += ["--use_peft", "--lora_target_modules", smollm2_recipe.LORA_TARGETS] if w["lora"] else []
    flags += w["ours"]  # smollm2: the recipe's trainer threads
    flags += extra
    if trainer in VLLM_TRAINERS:
        flags += ["--max_model_len", "512"]  # the tiny model's context length
        flags += ["--gen_workers", str(gen_workers)] if trainer == "full" else []  # the lesson has one worker
        flags += ["--gen_compile"] if gen_compile and not lesson else []
    flags += ["--max_policy_lag", str(lag)] if lag is not None else []
    name = (f"bench_{trainer}_{'' if world == 'tiny' else world + '_'}L{completion_len}"
            + (f"_k{gen_workers}" if gen_workers > 1 else "") + (f"_lag{lag}" if lag is not None else ""))
    # a reference server only where there is a KL term and no LoRA base to stand in for it
    result = run(trainer, steps, skip, env, flags, run_name=name + (f"_seed{seed}" if seed else ""),
                 ref_server=w["beta"] > 0 and not w["lora"], eval_args=w["eval_args"])
    result.pop("trainer")
    result["peak_rss_trainer_mb"] = result["peak_rss_mb"]
    result["peak_rss_mb"] = result.pop("peak_rss_with_ref_mb")  # TRL's figure holds its reference model too
    if trainer in VLLM_TRAINERS:
        result["gen_compile"] = gen_compile and not lesson
    return result


def result_line(args, system, completion_len, result):
    """A system's JSON line: what ran (the world, the start where --start gave one, L, the seed), its figures."""
    return {"system": system, "world": args.world, **({"start": args.start} if args.start else {}),
            "completion_len": completion_len, "seed": args.seed, **result,
            "steps": args.steps, "timed_steps": args.steps - args.skip}


def table(results):
    """The results as a markdown table, a row per system and length (TRL's row first): completions/s and its ratio
    to TRL's at that length, s/step (median and quartiles), the policy lag seen (mean / max), peak memory."""
    trl = {r["completion_len"]: r["completions_per_s"] for r in results if r["system"] == "trl"}
    rows = ["| system | L | completions/s | x TRL | s/step median (quartiles) | policy lag mean / max | peak MB |",
            "|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["completion_len"], r["system"] != "trl")):
        ratio = f"{r['completions_per_s'] / trl[r['completion_len']]:.2f}" if r["completion_len"] in trl else ""
        iqr = f" ({r['s_per_step_iqr'][0]:.3f}-{r['s_per_step_iqr'][1]:.3f})" if "s_per_step_iqr" in r else ""
        lag = f"{r['policy_lag_mean']} / {r['policy_lag_max']}" if "policy_lag_mean" in r else ""
        rows.append(f"| {r['system']} | {r['completion_len']} | {r['completions_per_s']} | {ratio} | "
                    f"{r['s_per_step']:.3f}{iqr} | {lag} | {r['peak_rss_mb']} |")
    return "\n".join(rows)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=3, help="first steps left out of the timings")
    ap.add_argument("--lengths", default="32,256", help="completion lengths in tokens")
    ap.add_argument("--systems", default="trl,grpo_train,grpo_vllm_one,full", help=f"of {', '.join(SYSTEMS)}")
    ap.add_argument("--trl_gradient_checkpointing", default="off", choices=["off", "on"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gen_workers", default="1", help="full's generation worker counts, e.g. 1,2")
    ap.add_argument("--lags", default=None, help="full's --max_policy_lag values, e.g. 1,2,4: a row each "
                                                 "(full_lag2); default: its own default, not passed")
    ap.add_argument("--gen_compile", default="on", choices=["on", "off"], help="the vLLM trainers' --gen_compile")
    ap.add_argument("--ours_flags", default="", help="more flags for our trainers, e.g. \"--max_policy_lag 0\"")
    ap.add_argument("--world", default="tiny", choices=["tiny", "smollm2"],
                    help="tiny: the tiny default model; smollm2: make demo-real's warm-started SmolLM2 and recipe")
    ap.add_argument("--start", default=None, metavar="DIR",
                    help="a model directory (config.json and a tokenizer) every system starts from, with the "
                         "world's recipe otherwise (default: the world's own start)")
    ap.add_argument("--trl_child", type=int, default=0, help=argparse.SUPPRESS)  # internal: run TRL, length L
    ap.add_argument("--out_dir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.start is not None:  # the systems run from the repository root
        args.start = os.path.abspath(args.start)
    return args


def main(argv=None):
    args = parse_args(argv)
    env = child_env()
    if args.trl_child:
        w = world_settings(args.world, env, args.start)
        trl_train(args.trl_child, args.steps, args.out_dir, args.trl_gradient_checkpointing == "on", args.seed, w)
        return
    systems, lengths = args.systems.split(","), [int(x) for x in args.lengths.split(",")]
    for system in systems:
        if system not in SYSTEMS:
            raise SystemExit(f"unknown system {system!r}: use {', '.join(SYSTEMS)}")
    if args.skip >= args.steps:
        raise SystemExit(f"--skip {args.skip} leaves no timed steps of --steps {args.steps}")
    if args.lags is not None and "--max_policy_lag" in args.ours_flags.split():
        raise SystemExit("--lags and --ours_flags \"--max_policy_lag ...\" both set full's lag: give it once")
    # stdout carries only the JSON lines: everything else (our logs, the children's) goes to stderr
    results_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    w = world_settings(args.world, env, args.start)
    if set(systems) - {"trl"}:
        build_deepspeed_ops(env)
    worker_counts = [int(k) for k in args.gen_workers.split(",")]
    lags = [int(lag) for lag in args.lags.split(",")] if args.lags is not None else [None]
    runs = [(s, k, lag) for s in systems for k in (worker_counts if s == "full" else [1])
            for lag in (lags if s == "full" else [None])]
    speed, results = {}, []
    for completion_len in lengths:
        for system, k, lag in runs:
            name = system + (f"_k{k}" if k > 1 else "") + (f"_lag{lag}" if lag is not None else "")
            if system == "trl":
                result = run_trl(completion_len, args.steps, args.skip, env, args.trl_gradient_checkpointing, args.seed,
                                 args.world, w, args.start)
            else:
                result = run_ours(system, completion_len, args.steps, args.skip, env, args.seed, args.world, w, k,
                                  args.gen_compile == "on", args.ours_flags.split(), lag)
                result["ours_flags"] = args.ours_flags
            result = result_line(args, name, completion_len, result)
            speed[name, completion_len] = result["completions_per_s"]
            results.append(result)
            print(json.dumps(result), file=results_out, flush=True)
    if "trl" in systems and len(runs) > 1:
        for completion_len in lengths:
            ratios = {name: round(speed[name, completion_len] / speed["trl", completion_len], 2)
                      for name, length in speed if length == completion_len and name != "trl"}
            print(json.dumps({"completion_len": completion_len, "completions_per_s_vs_trl": ratios}),
                  file=results_out, flush=True)
    print(table(results), file=sys.stderr, flush=True)  # the same figures to read (stdout keeps the JSON lines)


if __name__ == "__main__":
    main()
