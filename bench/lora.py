"""bench/lora.py: what a GRPO step costs with LoRA adapters and without, on one model, on this machine.

    python bench/lora.py                                                  # the tiny default model
    python bench/lora.py --model .cache/models/SmolLM2-135M-Instruct --steps 8 -- --max_new_tokens 64

The full trainer (python -m simple_grpo.train; LoRA is its) runs --steps steps twice with the same seed, data,
beta and lr: the full model (its reference in a ref server, as usual), then --use_peft (the reference is the
base with the adapters off, in the trainer). Flags after -- go to both runs (--lora_target_modules all-linear, say). Prints one JSON
line per run; the first --skip steps are left out of the medians:
  compute_s_median  the update: log-probs, loss, backward, optimizer step
  ref_s_median      the reference log-probs: the ref server's round trip, or LoRA's adapters-off forward
  step_s_median     the whole step, the wait for vLLM's batch included
  peak_rss_mb       the trainer's peak resident memory; peak_rss_with_ref_mb adds the ref server's
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from bench.harness import build_deepspeed_ops, wait_peak_rss  # noqa: E402
from tools.launch import MODEL, ROOT, TINY_WORLD_FLAGS, child_env, free_port, start_ref_server  # noqa: E402
from simple_grpo.run.metrics import read_metrics  # noqa: E402
from simple_grpo.run.checkpoints import runs_root  # noqa: E402


def run(model, lora, args, env):
    name = f"bench_lora_{'on' if lora else 'off'}"
    flags = ["-m", "simple_grpo.train", "--model", model, "--steps", str(args.steps), "--save_every", str(args.steps),
             "--seed", str(args.seed), "--lr", str(args.lr), "--run_name", name, "--overwrite", *args.extra]
    server = None
    if lora:
        flags.append("--use_peft")
    else:
        port = free_port()
        server = start_ref_server(port, env, "--model", model)
        flags += ["--ref_url", f"http://127.0.0.1:{port}"]
    try:
        proc = subprocess.Popen([sys.executable, *flags], cwd=ROOT, env=env)
        peak, peak_with_ref = wait_peak_rss(proc, also=server)
        if proc.returncode != 0:
            raise SystemExit(f"python -m simple_grpo.train {'--use_peft ' if lora else ''}failed with exit code "
                             f"{proc.returncode}")
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    rows, _ = read_metrics(os.path.join(ROOT, runs_root(), name, "metrics.jsonl"))
    timed = rows[args.skip:]
    median = lambda key: round(statistics.median(r[key] for r in timed), 3)  # noqa: E731
    return {"lora": lora, "model": model, "steps": len(timed), "compute_s_median": median("compute_s"),
            "ref_s_median": median("ref_s"), "step_s_median": median("step_s"),
            "peak_rss_mb": round(peak / 2**20), "peak_rss_with_ref_mb": round(peak_with_ref / 2**20),
            "reward_mean_last": rows[-1]["reward_mean"], "kl_last": rows[-1]["kl"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=3, help="first steps left out of the medians")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=float(TINY_WORLD_FLAGS[1]), help="both runs' (default: the tiny world's)")
    ap.add_argument("extra", nargs="*", help="flags for both runs, after --")
    args = ap.parse_args()
    if args.steps <= args.skip:
        raise SystemExit(f"--steps {args.steps} leaves nothing to time after --skip {args.skip}")
    env = child_env()
    build_deepspeed_ops(env)
    for lora in (False, True):
        print(json.dumps(run(args.model, lora, args, env)), flush=True)


if __name__ == "__main__":
    main()
