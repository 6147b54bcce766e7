"""bench/trainers.py: grpo_train.py and grpo_vllm_one.py side by side on the tiny default.

    python bench/trainers.py [--steps 100] [--trainers grpo_train,grpo_vllm_one] [--gen_workers 1,2]

Each trainer runs the same number of steps with its own reference server (tools/demo.py's
start-up), then its last checkpoint is evaluated greedily on the test split; grpo_vllm_one once
per --gen_workers count. Prints one JSON line per run:
  completions_per_s  completions sampled per second of the training loop (steps * Q * G / time)
  s_per_step         median wall time of one optimizer step
  gen_s_median       median time to sample one step's batch (in the worker for grpo_vllm_one)
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
import statistics
import subprocess
import sys
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from metrics import read_metrics  # noqa: E402
from tools.demo import TINY_WORLD_FLAGS, evaluate, free_port, start_ref_server  # noqa: E402


def tree_rss(proc):
    """Resident memory of a process and all its children, in bytes."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def wait_peak_rss(proc, also=None):
    """Wait for PROC to exit, sampling memory every 0.2 s; returns its tree's peak RSS in bytes,
    and the peak of its tree plus ALSO's (another process, sampled at the same moments)."""
    watched, other, peak, peak_with = psutil.Process(proc.pid), also and psutil.Process(also.pid), 0, 0
    while proc.poll() is None:
        try:
            rss = tree_rss(watched)
            peak, peak_with = max(peak, rss), max(peak_with, rss + (tree_rss(other) if other else 0))
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.2)
    return peak, peak_with


def build_deepspeed_ops(env):
    """Compile DeepSpeed's CPU comm op now, where grpo_train.py keeps it (.cache/torch_extensions).
    Its first use builds it (about a minute, and a C++ compiler of ~2.7 GB that a fresh checkout's
    first measured run would otherwise count as its own memory). Nothing to build on CUDA."""
    code = ("import deepspeed; from deepspeed.comm.torch import build_shm_op; "
            "print('DeepSpeed comm op:', 'ready' if build_shm_op() else 'none for this accelerator')")
    extensions = os.path.join(ROOT, ".cache", "torch_extensions")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={"TORCH_EXTENSIONS_DIR": extensions, **env},
                   stdout=sys.stderr, check=True)


def run(trainer, steps, skip, env, extra, run_name=None):
    port = free_port()
    server = start_ref_server(port, env)
    run_name = run_name or f"bench_{trainer}"
    try:
        t0 = time.time()
        proc = subprocess.Popen([sys.executable, f"{trainer}.py", "--ref_url", f"http://127.0.0.1:{port}",
                                 "--run_name", run_name, "--overwrite", "--steps", str(steps),
                                 "--save_every", str(steps), *TINY_WORLD_FLAGS, *extra],
                                cwd=ROOT, env=env)
        peak, peak_with_ref = wait_peak_rss(proc, also=server)
        if proc.returncode != 0:
            raise SystemExit(f"{trainer}.py failed with exit code {proc.returncode}")
        print(f"{trainer}: {steps} steps in {time.time() - t0:.0f} s with start-up", file=sys.stderr)
    finally:
        server.terminate()
        server.wait(timeout=30)
    rows, _ = read_metrics(os.path.join(ROOT, "runs", run_name, "metrics.jsonl"))  # steps, not the doctor's warnings
    timed = rows[skip:]
    config = json.load(open(os.path.join(ROOT, "runs", run_name, "config.json")))
    completions = len(timed) * config["batch_prompts"] * config["num_generations"]
    after = evaluate(os.path.join("runs", run_name, f"step_{steps}"), env)
    return {"trainer": trainer,
            "completions_per_s": round(completions / sum(r["step_s"] for r in timed), 2),
            "s_per_step": round(statistics.median(r["step_s"] for r in timed), 3),
            "gen_s_median": round(statistics.median(r["gen_s"] for r in timed), 3),
            "compute_s_median": round(statistics.median(r["compute_s"] for r in timed), 3),
            "peak_rss_mb": round(peak / 2**20), "peak_rss_with_ref_mb": round(peak_with_ref / 2**20),
            "completion_len_mean": round(statistics.mean(r["completion_len"] for r in timed), 1),
            "accuracy_after": after["accuracy"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of the timings")
    ap.add_argument("--trainers", default="grpo_train,grpo_vllm_one")
    ap.add_argument("--gen_workers", default="1", help="grpo_vllm_one's generation worker counts, e.g. 1,2")
    ap.add_argument("extra", nargs="*", help="flags for both trainers, after --")
    args = ap.parse_args()
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    trainers = args.trainers.split(",")
    for trainer in trainers:
        if trainer not in ("grpo_train", "grpo_vllm_one"):
            raise SystemExit(f"unknown trainer {trainer!r}: grpo_train or grpo_vllm_one")
    build_deepspeed_ops(env)
    for trainer in trainers:
        for k in [int(k) for k in args.gen_workers.split(",")] if trainer == "grpo_vllm_one" else [1]:
            extra, name = args.extra, None
            if k > 1:
                extra, name = [*args.extra, "--gen_workers", str(k)], f"bench_{trainer}_k{k}"
            print(json.dumps({**run(trainer, args.steps, args.skip, env, extra, run_name=name), "gen_workers": k}),
                  flush=True)


if __name__ == "__main__":
    main()
