"""bench/offload_optimizer.py: one host-side AdamW step over a Qwen2.5-0.5B-shaped parameter set, as
--offload_optimizer runs it, before and after the optimizer was given the host's cores.

    python bench/offload_optimizer.py [--model configs/qwen2.5-0.5b] [--repeats 3] [--threads 0]

The parameters are built from the config on the meta device for their shapes, then one flat fp32 tensor of
that many elements with a random gradient is stepped: ZeRO-1/2's offload keeps this rank's master weights
as one flat fp32 partition and calls torch's AdamW on it (grad, exp_avg, exp_avg_sq beside it: 16 bytes a
parameter, ~7.9 GB for 0.5B). Set-ups:
  before:  torch.set_num_threads(1) (the trainers' --threads on a GPU machine), AdamW's default on CPU
           (a for-loop over parameters, no fused kernel): the trainers' offload until now;
  threads: the same AdamW on --threads threads (0: the cores this process may use);
  after:   fused AdamW on those threads: what the trainers run now (deepspeed_engine.py).
Prints one line per set-up and a JSON line {set-up: median seconds per step}. The first step (which makes
Adam's moments) is not timed.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from simple_grpo.trainer.memory_plan import count_parameters  # noqa: E402


def step_seconds(params, threads, fused, repeats):
    """Median seconds of one AdamW step on `threads` threads (one untimed step first)."""
    torch.set_num_threads(threads)
    optimizer = torch.optim.AdamW([params], lr=1e-6, betas=(0.9, 0.99), weight_decay=0.0,
                                  **({"fused": True} if fused else {"foreach": False}))
    optimizer.step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    optimizer.state.clear()  # the moments' memory back before the next set-up
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.path.join(ROOT, "configs", "qwen2.5-0.5b"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="threads for 'threads' and 'after' (0: all cores)")
    args = parser.parse_args()
    n = count_parameters(args.model)["params"]
    threads = args.threads or len(os.sched_getaffinity(0))
    params = torch.nn.Parameter(torch.randn(n) * 0.02)
    params.grad = torch.randn(n) * 1e-3
    print(f"{n / 1e6:.0f}M parameters from {os.path.relpath(args.model, ROOT)} (fp32, one flat partition); "
          f"{threads} threads; median of {args.repeats} steps")
    results = {}
    for name, t, fused in (("before", 1, False), ("threads", threads, False), ("after", threads, True)):
        results[name] = round(step_seconds(params, t, fused, args.repeats), 3)
        print(f"{name:<8} {t} thread(s), {'fused' if fused else 'for-loop'} AdamW: {results[name]:.3f} s per step",
              flush=True)
    print(f"after / before: {results['before'] / results['after']:.2f}x faster")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
