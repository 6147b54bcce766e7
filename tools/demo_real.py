"""`make demo-real`: GRPO makes a real pretrained model, SmolLM2-135M-Instruct, better on this CPU.

    python tools/demo_real.py [--seed 1] [--steps 40] [--n 500] [-- extra trainer flags]

1. fetches SmolLM2-135M-Instruct and converts it (tools/fetch_smollm2.py; once, then cached);
2. warm start: it never writes the <answer> tags, so GRPO would get no signal; a short supervised
   start on solved training problems, half of them in the <think>/<answer> format and half in
   other styles, teaches the format without settling it (tools/warm_start.py; cached in
   .cache/models/, so a second seed skips it);
3. probes the warm-started model: does GRPO get a signal from it? (tools/probe.py);
4. evaluates greedily on the held-out test split the untouched model ("base") and the warm-started
   one, GRPO's start ("before");
5. trains LoRA adapters with grpo_vllm_one.py into runs/demo_real_seedN/, with its report.html (the
   settings: simple_grpo/run/smollm2_recipe.py; the search for them: docs/real_model.md);
6. evaluates the final checkpoint ("after") and pairs it with "before", problem by problem: the gain
   in accuracy with its 95% interval;
7. prints a table and one last JSON line {"base", "before", "after", "gain", "minutes"}.
The trainer is stopped at the end, on errors, on Ctrl-C and on SIGTERM.
"""
import argparse
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from simple_grpo.evaluation import paired_gain, print_before_after, read_details  # noqa: E402
from simple_grpo.run.launch import ROOT, TEST, evaluate, smollm2_warm_start, stop  # noqa: E402
from simple_grpo.run.smollm2_recipe import EVAL_FLAGS, SAMPLING_FLAGS, STEPS, SYSTEM_PROMPT, TRAIN_FLAGS  # noqa: E402

KEEP = ("accuracy", "format_rate", "accuracy_in_format", "mean_tokens", "n")


def run(cmd, env, what):
    """A step of the demo as a child process, stopped with us; its failure stops the demo naming it."""
    proc = subprocess.Popen([sys.executable, *cmd], cwd=ROOT, env=env)
    try:
        if proc.wait() != 0:
            raise SystemExit(f"{what} failed with exit code {proc.returncode}")
    finally:
        stop(proc)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0, help="seed of GRPO's problem draws and sampling")
    ap.add_argument("--steps", type=int, default=STEPS, help="GRPO steps")
    ap.add_argument("--n", type=int, default=500, help="held-out test problems evaluated (500: all)")
    ap.add_argument("--run_name", default=None, help="default: demo_real_seedN")
    ap.add_argument("train_args", nargs="*", help="extra grpo_vllm_one.py flags, after --")
    args = ap.parse_args()
    run_name = args.run_name or f"demo_real_seed{args.seed}"
    run_dir = os.path.join(ROOT, "runs", run_name)
    # two busy processes on two cores: OpenMP threads must sleep, not spin, while they wait
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `kill` runs the clean-up too
    t0 = time.time()
    prompt = ["--system_prompt", SYSTEM_PROMPT]

    print("\n== 1/5 SmolLM2-135M-Instruct (tools/fetch_smollm2.py: fetched and converted once), and its warm start",
          flush=True)
    base, warm = smollm2_warm_start(env)

    print("\n== 2/5 probe: will GRPO get a signal from the warm-started model?", flush=True)
    run(["tools/probe.py", "--model", warm, "--n", "32", *prompt, *SAMPLING_FLAGS], env, "the probe")

    print(f"\n== 3/5 evaluate the untouched model (base) and the warm-started one (before) on {args.n} test problems",
          flush=True)
    os.makedirs(run_dir, exist_ok=True)
    eval_args = [*prompt, *EVAL_FLAGS, "--n", str(args.n)]
    details = {name: os.path.join(run_dir, f"eval_{name}.jsonl") for name in ("base", "before", "after")}
    figures = {"base": evaluate(base, env, TEST, [*eval_args, "--details", details["base"]]),
               "before": evaluate(warm, env, TEST, [*eval_args, "--details", details["before"]])}

    print(f"\n== 4/5 GRPO with grpo_vllm_one.py, seed {args.seed}, {args.steps} steps -> runs/{run_name}", flush=True)
    # a group's completions every 2 steps for report.html: the bare answers of the first steps, then the reasoning
    run(["grpo_vllm_one.py", "--model", warm, *prompt, *TRAIN_FLAGS, "--save_every", "1000",
         "--log_completions_every", "2", "--run_name", run_name, "--overwrite", "--seed", str(args.seed),
         "--steps", str(args.steps), *args.train_args], env, "grpo_vllm_one.py")

    print("\n== 5/5 evaluate the trained model (after)", flush=True)
    figures["after"] = evaluate(os.path.join(run_dir, f"step_{args.steps}"), env, TEST,
                                [*eval_args, "--details", details["after"]])
    gain = paired_gain(read_details(details["before"]), read_details(details["after"]))
    report = {name: {k: figures[name][k] for k in KEEP} for name in ("base", "before", "after")}
    report["gain"] = {"accuracy": round(gain["gain"], 4), "ci95": [round(x, 4) for x in gain["ci95"]],
                      "won": gain["won"], "lost": gain["lost"]}
    report["minutes"] = round((time.time() - t0) / 60, 2)
    print_before_after(report, ("base", "before", "after"),
                       f"GRPO's gain in accuracy on the same {gain['n']} problems: {gain['gain']:+.3f}, 95% interval "
                       f"[{gain['ci95'][0]:+.3f}, {gain['ci95'][1]:+.3f}] (right after but not before: {gain['won']}, "
                       f"the other way: {gain['lost']}); {report['minutes']:.1f} minutes. Curves: "
                       f"runs/{run_name}/curves.png, report: runs/{run_name}/report.html")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
