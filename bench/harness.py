"""What the benches share (not a bench itself): the work every compared system gets, a trainer run with
its own reference server and its peak memory, and the DeepSpeed op built before anything is timed."""
import json
import os
import statistics
import subprocess
import sys
import time

import psutil

from simple_grpo.train import Config
from tools.launch import ROOT, TINY_WORLD_FLAGS, TRAINER_ARGS, evaluate, free_port, start_ref_server, stop
from simple_grpo.run.checkpoints import runs_root
from simple_grpo.run.metrics import read_metrics
from simple_grpo.trainer.deepspeed_engine import clear_stale_build_locks

# The shared settings: every system gets exactly these.
TRAIN = "data/toy_math/train.jsonl"
PROMPTS, GROUP = 8, 8  # prompts per step, completions per prompt
LR, BETA, TEMPERATURE = 1e-4, 0.04, 0.7
REWARD_WEIGHTS = {"correctness": 1.0, "format": 0.5}


SamplerConfig = Config  # the flags the full trainer's worker reads: what the benches that start vLLM pass to sample


def tree_sum(proc, memory):
    """memory(p) summed over a process and all its children, in bytes (a process gone meanwhile counts 0)."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += memory(p)
        except psutil.NoSuchProcess:
            pass
    return total


def tree_rss(proc):
    """Resident memory of a process and all its children, in bytes."""
    return tree_sum(proc, lambda p: p.memory_info().rss)


def tree_pss(proc):
    """Proportional memory of a process and all its children, in bytes: a page that k processes map counts 1/k
    in each, so the sum counts shared memory once (tree_rss counts it in every process that maps it)."""
    return tree_sum(proc, lambda p: p.memory_full_info().pss)


def wait_peak_rss(proc, also=None, measure=tree_rss):
    """Wait for PROC to exit, sampling memory (measure: tree_rss or tree_pss) every 0.2 s; returns its tree's
    peak in bytes, and the peak of its tree plus ALSO's (another process, sampled at the same moments)."""
    watched, other, peak, peak_with = psutil.Process(proc.pid), also and psutil.Process(also.pid), 0, 0
    while proc.poll() is None:
        try:
            rss = measure(watched)
            peak, peak_with = max(peak, rss), max(peak_with, rss + (measure(other) if other else 0))
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
    clear_stale_build_locks(extensions)  # a killed build's lock would make this wait forever
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={"TORCH_EXTENSIONS_DIR": extensions, **env},
                   stdout=sys.stderr, check=True)


def run(trainer, steps, skip, env, extra, run_name=None, ref_server=True, eval_args=()):
    """A trainer's run (its name in TRAINER_ARGS) of `steps` (tiny world flags, then `extra`), with its own
    reference server unless ref_server is False (beta 0, or LoRA's base as the reference); timed, its peak memory
    sampled, evaluated."""
    port = free_port()
    server = start_ref_server(port, env) if ref_server else None
    run_name = run_name or f"bench_{trainer}"
    try:
        t0 = time.time()
        proc = subprocess.Popen([sys.executable, *TRAINER_ARGS[trainer], *(["--ref_url", f"http://127.0.0.1:{port}"]
                                                                           if server else []),
                                 "--run_name", run_name, "--overwrite", "--steps", str(steps),
                                 "--save_every", str(steps), *TINY_WORLD_FLAGS, *extra],
                                cwd=ROOT, env=env)
        peak, peak_with_ref = wait_peak_rss(proc, also=server)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(TRAINER_ARGS[trainer])} failed with exit code {proc.returncode}")
        print(f"{trainer}: {steps} steps in {time.time() - t0:.0f} s with start-up", file=sys.stderr)
    finally:
        stop(server)
    run_dir = os.path.join(ROOT, runs_root(), run_name)
    rows, _ = read_metrics(os.path.join(run_dir, "metrics.jsonl"))  # steps, not the doctor's warnings
    timed = rows[skip:]
    config = json.load(open(os.path.join(run_dir, "config.json")))
    completions = len(timed) * config["batch_prompts"] * config["num_generations"]
    after = evaluate(os.path.join(runs_root(), run_name, f"step_{steps}"), env, args=eval_args)
    # the policy lag of each batch the timed steps trained on (batch_lags where the full trainer logs them, at
    # --max_policy_lag >= 2; else each step's policy_lag; grpo_train.py, which samples for itself, logs none)
    lags = [lag for r in timed if "policy_lag" in r for lag in r.get("batch_lags", [r["policy_lag"]])]
    lag_figures = {"policy_lag_mean": round(statistics.mean(lags), 2), "policy_lag_max": max(lags)} if lags else {}
    return {**lag_figures, "trainer": trainer,
            "completions_per_s": round(completions / sum(r["step_s"] for r in timed), 2),
            "s_per_step": round(statistics.median(r["step_s"] for r in timed), 3),
            "s_per_step_iqr": [round(q, 3) for q in statistics.quantiles([r["step_s"] for r in timed])[::2]],
            "gen_s_median": round(statistics.median(r["gen_s"] for r in timed), 3),
            "compute_s_median": round(statistics.median(r["compute_s"] for r in timed), 3),
            "peak_rss_mb": round(peak / 2**20), "peak_rss_with_ref_mb": round(peak_with_ref / 2**20),
            "completion_len_mean": round(statistics.mean(r["completion_len"] for r in timed), 1),
            "accuracy_after": after["accuracy"]}
