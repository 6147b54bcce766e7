"""bench/regroup.py: the base pipeline against regroup_ver/, for the same number of generated completions.

    python bench/regroup.py [--completions 19200] [--seed 0]

base:    ref_server.py + python -m simple_grpo.train; groups whose answers all scored alike are dropped.
regroup: regroup_ver/ref_server_regroup.py + regroup_ver/grpo_regroup.py; they are pooled and
         their questions asked once more, and groups with mixed rewards are formed from the pools.
Each trainer stops once its worker has generated --completions completions
(--max_completions), then its last checkpoint is evaluated greedily on the test split.
Prints one JSON line per pipeline:
  useful_fraction  completions in a trained group / completions generated (a trained group has
                   mixed rewards, so its completions reach the gradient)
  accuracy_after   greedy test accuracy of the last checkpoint
with the steps taken, the median policy lag and the minutes it took.
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
from simple_grpo.run.metrics import read_metrics  # noqa: E402
from simple_grpo.run.checkpoints import runs_root  # noqa: E402
from tools.launch import TINY_WORLD_FLAGS, TRAINER_ARGS, child_env, evaluate, free_port, start_ref_server  # noqa: E402

PIPELINES = {"base": ("ref_server.py", TRAINER_ARGS["full"]),  # the server, the trainer's args after python
             "regroup": ("regroup_ver/ref_server_regroup.py", ["regroup_ver/grpo_regroup.py"])}


def run(pipeline, completions, seed, env):
    server_script, trainer_args = PIPELINES[pipeline]
    port, run_name = free_port(), f"bench_regroup_{pipeline}"
    server = start_ref_server(port, env, script=server_script)
    t0 = time.time()
    try:
        subprocess.run([sys.executable, *trainer_args, "--ref_url", f"http://127.0.0.1:{port}",
                        "--run_name", run_name, "--overwrite", "--seed", str(seed),
                        "--steps", "100000", "--save_every", "100000",
                        "--max_completions", str(completions), *TINY_WORLD_FLAGS], cwd=ROOT, env=env, check=True)
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"{' '.join(trainer_args)} failed with exit code {e.returncode}") from None
    finally:
        server.terminate()
        server.wait(timeout=30)
    minutes = (time.time() - t0) / 60
    run_dir = os.path.join(ROOT, runs_root(), run_name)
    rows, _ = read_metrics(os.path.join(run_dir, "metrics.jsonl"))  # steps, not the doctor's warnings
    last = rows[-1]
    after = evaluate(os.path.join(runs_root(), run_name, f"step_{last['step']}"), env)
    return {"pipeline": pipeline, "useful_fraction": round(last["trained"] / last["generated"], 3),
            "accuracy_after": after["accuracy"], "format_after": after["format_rate"],
            "generated": last["generated"], "trained": last["trained"], "steps": last["step"],
            "policy_lag_median": statistics.median(r["policy_lag"] for r in rows), "minutes": round(minutes, 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--completions", type=int, default=19200, help="generation budget of each pipeline")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pipelines", default="base,regroup")
    args = ap.parse_args()
    env = child_env()
    for pipeline in args.pipelines.split(","):
        if pipeline not in PIPELINES:
            raise SystemExit(f"unknown pipeline {pipeline!r}: base or regroup")
        print(json.dumps(run(pipeline, args.completions, args.seed, env)), flush=True)


if __name__ == "__main__":
    main()
