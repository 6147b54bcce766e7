"""A real pretrained model trained by simple_grpo.train on a GPU (issue 58, point 5): SmolLM2-135M-Instruct from the
supervised start `make demo-real SETTING=answers` makes (its 300 worked solutions), trained in full, bf16, vLLM on
the same GPU, on the other training problems' final answers (as the CPU study's GRPO arm) with the GSM8K recipe's
8 x 8 batch; greedy accuracy on the test problems before and after, the paired gain with its 95% interval, seconds
a step, and the sampler gap (vLLM against the trainer) on real weights.

    python tools/gpu_real.py --start .cache/models/SmolLM2-135M-Instruct-warm-KEY --minutes 5   # on a GPU
    python tools/gpu_real.py --start models/tiny-math --system_prompt "" --n 16 --steps 2 --dtype float32 \
        -- --batch_prompts 2 --num_generations 4 --max_new_tokens 16                            # its tiny CPU form

--minutes M bounds the training to M minutes, start-up included: the trainer saves a checkpoint every --save_every
steps and is stopped (SIGTERM) when the time is up; the last checkpoint it saved is the one evaluated, and the report
says how many steps that was. A visit to a lent GPU has a fixed budget and no measured s/step yet: this bounds it.
The start is made on the build machine (`make demo-real SETTING=answers`, ~50 min on 2 cores; its directory is
printed there) and carried to the GPU machine with ../shared/gpu's MODEL=DIR. Flags after -- go to the trainer and
win over this tool's. The evaluations and the data go to runs/RUN_NAME/, the trainer's run to runs/RUN_NAME_grpo/.
Prints a table and one last JSON line {"start", "after", "gain", "steps", "s_per_step", "sampler_gap_mean",
"sampler_gap_max", "doctor_warnings", "minutes", "commit", "tree", "trainer_flags"}, also written to
runs/RUN_NAME/report.json. "tree" records the tree that ran (simple_grpo/run/provenance.py: on a GPU visit the
commit carried with the tree, checked against its files there, whose git may read another commit); "commit" is its
commit.
"""
import argparse
import json
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from simple_grpo.evaluation import paired_gain, print_before_after, read_details  # noqa: E402
from simple_grpo.run.checkpoints import runs_root  # noqa: E402
from simple_grpo.run.provenance import what_ran  # noqa: E402
from tools.launch import ROOT, TEST, TRAINER_ARGS, child_env, evaluate, run_child, trained_checkpoint  # noqa: E402
from tools.smollm2_recipe import EVAL_FLAGS, MAX_NEW_TOKENS, SYSTEM_PROMPT, write_answers_only  # noqa: E402

KEEP = ("accuracy", "accuracy_strict", "format_rate", "mean_tokens", "n")


def trainer_flags(args, answers_only):
    """The full trainer's command (after python): full fine-tuning (no LoRA), beta 0 (no reference pass, as the
    recipe), the GSM8K recipe's 8 prompts x 8 completions, one checkpoint at the end; then the flags after --."""
    prompt = ["--system_prompt", args.system_prompt] if args.system_prompt else []
    return [*TRAINER_ARGS["full"], "--model", args.start, "--dataset", answers_only, *prompt, "--dtype", args.dtype,
            "--lr", str(args.lr), "--beta", "0", "--batch_prompts", "8", "--num_generations", "8",
            "--max_new_tokens", str(MAX_NEW_TOKENS), "--steps", str(args.steps),
            "--save_every", str(args.save_every or (25 if args.minutes else args.steps)),
            "--seed", str(args.seed), "--run_name", args.run_name + "_grpo", "--overwrite", *args.train_args]


def run_figures(run_dir):
    """From the run's metrics.jsonl: the median seconds a step after the first (start-up and vLLM's warm-up are in
    the first), and the sampler gap per token over the run (mean of the steps' means; the largest)."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    steps = [r for r in rows if "warning" not in r]
    timed = [r["step_s"] for r in steps[1:]] or [r["step_s"] for r in steps]
    gaps = [r for r in steps if "sampler_gap_mean" in r]
    return {"s_per_step": statistics.median(timed),
            "sampler_gap_mean": statistics.mean(r["sampler_gap_mean"] for r in gaps) if gaps else None,
            "sampler_gap_max": max(r["sampler_gap_max"] for r in gaps) if gaps else None,
            "doctor_warnings": [r["warning"] for r in rows if "warning" in r]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--start", required=True, help="the supervised start's directory (make demo-real SETTING=answers)")
    ap.add_argument("--steps", type=int, default=200, help="GRPO steps (about 5 minutes' worth on an H100: pick "
                                                             "from a first short run's s_per_step)")
    ap.add_argument("--minutes", type=float, default=0, help="stop the training after this many minutes, start-up "
                                                              "included, and evaluate its last checkpoint (0: no limit)")
    ap.add_argument("--save_every", type=int, default=0, help="steps between checkpoints (0: 25 with --minutes, else "
                                                              "one at the end); with --minutes the last saved is evaluated")
    ap.add_argument("--lr", type=float, default=1e-6, help="full fine-tuning's learning rate (the run doctor's usual "
                                                            "figure for a real model; not tuned for this one)")
    ap.add_argument("--dtype", default="bfloat16", help="the trainer's and vLLM's precision")
    ap.add_argument("--n", type=int, default=500, help="test problems evaluated before and after")
    ap.add_argument("--system_prompt", default=SYSTEM_PROMPT, help="the recipe's; \"\" keeps the trainer's default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run_name", default="gpu_real_seed0")
    ap.add_argument("train_args", nargs="*", help="extra trainer flags, after --")
    args = ap.parse_args()
    if not os.path.isdir(os.path.join(ROOT, args.start)):
        raise SystemExit(f"--start {args.start}: no such directory (make it with `make demo-real SETTING=answers`)")
    run_dir = os.path.join(ROOT, runs_root(), args.run_name)
    env, t0, tree = child_env(), time.time(), what_ran()  # read before anything runs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the child trainer is stopped with us
    os.makedirs(run_dir, exist_ok=True)
    answers_only = os.path.join(run_dir, "answers_only.jsonl")
    write_answers_only(answers_only)
    prompt = ["--system_prompt", args.system_prompt] if args.system_prompt else []
    eval_args = [*prompt, *EVAL_FLAGS, "--n", str(args.n), "--dtype", args.dtype]
    details = {name: os.path.join(run_dir, f"eval_{name}.jsonl") for name in ("start", "after")}

    print(f"\n== 1/3 the start, greedy on {args.n} test problems", flush=True)
    start = evaluate(args.start, env, TEST, [*eval_args, "--details", details["start"]])
    print(f"\n== 2/3 GRPO, full fine-tuning in {args.dtype}, {args.steps} steps of 8 x 8", flush=True)
    command = trainer_flags(args, answers_only)
    stopped = run_child(command, env, "simple_grpo.train", args.minutes)  # SIGTERM stops its vLLM worker too
    checkpoint, steps = trained_checkpoint(run_dir + "_grpo")
    print(f"\n== 3/3 after {steps} steps, greedy on the same problems", flush=True)
    after = evaluate(checkpoint, env, TEST, [*eval_args, "--details", details["after"]])

    gain = paired_gain(read_details(details["start"]), read_details(details["after"]))
    report = {"start": {k: start[k] for k in KEEP}, "after": {k: after[k] for k in KEEP},
              "gain": {"points": round(100 * gain["gain"], 1),
                       "ci95": [round(100 * g, 1) for g in gain["ci95"]], "won": gain["won"], "lost": gain["lost"]},
              "steps": steps, "stopped_by_time": stopped, **run_figures(run_dir + "_grpo"), "minutes": round((time.time() - t0) / 60, 2),
              "commit": tree["commit"], "tree": tree, "trainer_flags": command}
    with open(os.path.join(run_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print_before_after(report, ("start", "after"),
                       f"GRPO - start: {report['gain']['points']:+.1f} points, 95% [{report['gain']['ci95'][0]:+.1f}, "
                       f"{report['gain']['ci95'][1]:+.1f}] (paired per problem; {gain['won']} won, {gain['lost']} lost); "
                       f"{report['s_per_step']:.2f} s a step; sampler gap mean {report['sampler_gap_mean']}, max "
                       f"{report['sampler_gap_max']}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
