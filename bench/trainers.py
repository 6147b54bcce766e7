"""bench/trainers.py: grpo_train.py and the full trainer (python -m simple_grpo.train) side by side on the tiny
default (grpo_vllm_one: the lesson script).

    python bench/trainers.py [--steps 100] [--trainers grpo_train,full] [--gen_workers 1,2]

Each trainer runs the same number of steps with its own reference server (bench/harness.py's run,
which starts it as `make demo` does), then its last checkpoint is evaluated greedily on the test
split; full once per --gen_workers count. Prints one JSON line per run:
  completions_per_s  completions sampled per second of the training loop (steps * Q * G / time)
  s_per_step         median wall time of one optimizer step (s_per_step_iqr: its quartiles)
  gen_s_median       median time to sample one step's batch (in the worker for full and grpo_vllm_one)
  compute_s_median   median forward/backward/optimizer time of one step in the trainer
  peak_rss_mb        peak resident memory of the trainer and its children (the vLLM worker)
  peak_rss_with_ref_mb  the same with the reference server's added (sampled together)
  completion_len_mean   mean completion length in tokens
  accuracy_after     greedy test accuracy of the last checkpoint
The first steps (start-up, first batch) are left out of the medians: --skip.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from bench.harness import build_deepspeed_ops, run  # noqa: E402
from tools.launch import TRAINER_ARGS, child_env  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of the timings")
    ap.add_argument("--trainers", default="grpo_train,full", help=f"of {', '.join(TRAINER_ARGS)}")
    ap.add_argument("--gen_workers", default="1", help="the full trainer's generation worker counts, e.g. 1,2")
    ap.add_argument("extra", nargs="*", help="flags for both trainers, after --")
    args = ap.parse_args()
    env = child_env()
    trainers = args.trainers.split(",")
    for trainer in trainers:
        if trainer not in TRAINER_ARGS:
            raise SystemExit(f"unknown trainer {trainer!r}: {', '.join(TRAINER_ARGS)}")
    build_deepspeed_ops(env)
    for trainer in trainers:
        for k in [int(k) for k in args.gen_workers.split(",")] if trainer == "full" else [1]:
            extra, name = args.extra, None
            if k > 1:
                extra, name = [*args.extra, "--gen_workers", str(k)], f"bench_{trainer}_k{k}"
            print(json.dumps({**run(trainer, args.steps, args.skip, env, extra, run_name=name), "gen_workers": k}),
                  flush=True)


if __name__ == "__main__":
    main()
