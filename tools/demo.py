"""`make demo`: GRPO on the tiny default model, on CPU, with a before/after report.

    python tools/demo.py [--seed 1] [--steps 650] [--trainer grpo_train] [--lora] [-- extra trainer flags]

1. evaluates the shipped model greedily on the held-out test split;
2. starts ref_server.py in the background on a free port and waits for its /health (not with --lora: the
   base model, adapters off, is the reference);
3. trains with the full trainer (python -m simple_grpo.train), grpo_train.py or grpo_vllm_one.py (--trainer)
   into runs/NAME, replacing an earlier demo run of that name (the trainer's --overwrite);
4. evaluates the final checkpoint the same way, and writes runs/NAME/report.html (tools/view_run.py);
5. prints both as a table and one last JSON line {"before": {...}, "after": {...}, "minutes": m}.
The server and trainer are stopped at the end, on errors, on Ctrl-C and on SIGTERM.
"""
import argparse
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from simple_grpo.evaluation import print_before_after  # noqa: E402
from simple_grpo.run.checkpoints import runs_root  # noqa: E402
from tools.launch import (MODEL, ROOT, TINY_WORLD_FLAGS, TRAINER_ARGS, child_env, evaluate,  # noqa: E402
                          free_port, start_ref_server, stop)

# LoRA on the tiny model: adapters on every linear layer; lr 3e-4 (1e-3 learned less, and lost on seed 1:
# docs/benchmarks.md, LoRA)
LORA_FLAGS = ["--use_peft", "--lora_target_modules", "all-linear", "--lr", "3e-4"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=650)
    # grpo_vllm_one, the lesson: vLLM samples the next batch while the trainer computes; full: the same step with
    # every feature (python -m simple_grpo.train); grpo_train: the policy samples for itself
    ap.add_argument("--trainer", default="grpo_vllm_one", choices=list(TRAINER_ARGS))
    ap.add_argument("--lora", action="store_true", help="train LoRA adapters (--use_peft with LORA_FLAGS): the full "
                                                        "trainer's")
    ap.add_argument("--run_name", default=None, help="default: demo_vllm_seedN (the lesson), demo_full_seedN, "
                                                     "demo_seedN (grpo_train), demo_lora_...")
    ap.add_argument("train_args", nargs="*", help="extra trainer flags, after --")
    args = ap.parse_args()
    if args.lora and args.trainer != "full":
        print(f"--lora: LoRA is the full trainer's (python -m simple_grpo.train); {args.trainer} has none")
        args.trainer = "full"
    names = {"grpo_vllm_one": "vllm_", "full": "full_", "grpo_train": ""}
    run_name = args.run_name or (f"demo_{'lora_' if args.lora else ''}{names[args.trainer]}seed{args.seed}")
    # busy processes (trainer, ref server, vLLM worker) share the cores: OpenMP threads must sleep, not spin, while idle
    env = child_env()
    t0 = time.time()
    before = evaluate(MODEL, env)
    port = free_port()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `kill` runs the clean-up below too
    server, trainer = (None if args.lora else start_ref_server(port, env)), None
    flags = LORA_FLAGS if args.lora else ["--ref_url", f"http://127.0.0.1:{port}", *TINY_WORLD_FLAGS]
    try:
        trainer = subprocess.Popen([sys.executable, *TRAINER_ARGS[args.trainer], *flags,
                                    "--run_name", run_name, "--overwrite", "--seed", str(args.seed),
                                    "--steps", str(args.steps), *args.train_args], cwd=ROOT, env=env)
        if trainer.wait() != 0:
            raise SystemExit(f"{' '.join(TRAINER_ARGS[args.trainer])} failed with exit code {trainer.returncode}")
    finally:  # stop what we started; the trainer stops its own generation worker
        stop(trainer), stop(server)
    after = evaluate(os.path.join(runs_root(), run_name, f"step_{args.steps}"), env)
    subprocess.run([sys.executable, "tools/view_run.py", os.path.join(runs_root(), run_name)], cwd=ROOT, env=env)
    keep = ("accuracy", "format_rate", "accuracy_in_format", "n")
    report = {"before": {k: before[k] for k in keep}, "after": {k: after[k] for k in keep},
              "minutes": round((time.time() - t0) / 60, 2)}
    print_before_after(report, ("before", "after"),  # report.html: tools/view_run.py's page, curves included
                       f"{report['minutes']:.1f} minutes. Curves and completions: runs/{run_name}/report.html")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
