"""bench/logprob_memory.py: memory and time of the taken tokens' log-probs, forward + backward.

    python bench/logprob_memory.py [--B 8 --T 512 --V 151936] [--temperature 0.7]

Methods, on logits of B x T x V (Qwen2.5's vocabulary by default), fp32:
  naive    (logits / T).log_softmax(-1).gather(...)   the (B, T, V) log-softmax and its gradient whole
  chunked  simple_grpo.logprobs.selective_log_softmax the torch path grpo_vllm_one uses
  triton   triton_loss.selective_log_softmax_triton   on a GPU only (Triton's CPU interpreter is a test tool)
The logits are an intermediate, as a model's lm_head output is (here `leaf + 0`, whose backward
passes the gradient on unchanged); the gradient reaches the leaf. Each method runs in a fresh
process. Prints one JSON line per method:
  peak_extra_mb  peak memory during forward + backward above what the inputs held (CPU: peak RSS;
                 GPU: torch.cuda.max_memory_allocated)
  seconds        wall time of forward + backward (median of --repeats)
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(method, B, T, V, temperature, repeats):
    """In this process: one method's peak extra memory (first run) and median time."""
    import psutil
    import torch
    sys.path.insert(0, ROOT)
    from simple_grpo.logprobs import selective_log_softmax
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    leaf = torch.randn(B, T, V, device=device).requires_grad_()
    ids = torch.randint(0, V, (B, T), device=device)
    weights = torch.randn(B, T, device=device)

    def run():
        logits = leaf + 0  # an intermediate, like the lm_head's output
        if method == "naive":
            logps = (logits / temperature).log_softmax(-1).gather(-1, ids[..., None])[..., 0]
        elif method == "chunked":
            logps = selective_log_softmax(logits, ids, temperature)
        else:
            from triton_loss import selective_log_softmax_triton
            logps = selective_log_softmax_triton(logits, ids, temperature)
        (logps * weights).sum().backward()
        leaf.grad = None

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() + B * T * V * 4  # inputs, and the intermediate logits
        run()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before
    else:
        before = psutil.Process().memory_info().rss + B * T * V * 4
        run()
        extra = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    times = []
    for _ in range(repeats):
        t0 = time.time()
        run()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.time() - t0)
    return {"method": method, "peak_extra_mb": round(max(extra, 0) / 2**20), "seconds": round(statistics.median(times), 3),
            "device": device, "shape": [B, T, V]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--V", type=int, default=151936)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default="naive,chunked,triton")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure this method in this process
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.B, args.T, args.V, args.temperature, args.repeats)))
        return
    import torch
    for method in args.methods.split(","):
        if method not in ("naive", "chunked", "triton"):
            raise SystemExit(f"unknown method {method!r}: naive, chunked or triton")
        if method == "triton" and not torch.cuda.is_available():
            print(json.dumps({"method": "triton", "peak_extra_mb": None, "seconds": None,
                              "skipped": "no GPU: the kernel runs here only in Triton's interpreter (tests)"}))
            continue
        out = subprocess.run([sys.executable, __file__, "--one", method, "--B", str(args.B), "--T", str(args.T),
                              "--V", str(args.V), "--temperature", str(args.temperature),
                              "--repeats", str(args.repeats)], stdout=subprocess.PIPE, text=True, check=True)
        print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
