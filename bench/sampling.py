"""bench/sampling.py: one generation worker's sampling time per batch, by vLLM's KV-cache block size, and by the
batches sampled in one vLLM call.

    python bench/sampling.py [--lengths 32,256] [--block_sizes 128,32] [--repeats 8] [--gen_compile off]
    python bench/sampling.py --block_sizes 32 --batches 1,2,4    # issue 74: does a call of k batches pay?

As grpo_vllm_one.py's worker does on a CPU (simple_grpo/generation/vllm_sampler.py: start_vllm,
sample), on one core of its own: the tiny default model samples batches of 8 problems x 8 completions from the toy task,
every completion exactly L tokens (min_new_tokens = max_new_tokens, as bench/compare_trl.py).
A group's 8 completions share their prompt's KV cache only a whole block at a time (vLLM's
prefix caching): 128-token blocks (vLLM's CPU default) share nothing of a prompt shorter than
128 tokens, and one block of a longer one; 32-token blocks (vllm_sampler.CPU_BLOCK_SIZE) share
all but its last few tokens. Also times the prompts alone (L = 1). Prints one JSON line per
block size and length: the median seconds per batch over --repeats (the first batch excluded).
--batches 1,2,4 samples k batches (k x 8 problems) in each vLLM call, as the full trainer's worker does at
--max_policy_lag k, and prints a line per k too: s_per_call, s_per_batch (s_per_call / k) and ms_per_token_step
(s_per_call / L: the time of one decode step of all k x 64 sequences, prefill spread over it). A call of k batches
pays when s_per_batch falls with k.
"""
import argparse
import contextlib
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.harness import GROUP, PROMPTS, TEMPERATURE, TRAIN, SamplerConfig  # noqa: E402 - the same work
from simple_grpo.task.problems import load_data, make_prompt, stop_token_ids  # noqa: E402
from simple_grpo.generation.vllm_sampler import sample, start_vllm  # noqa: E402
from simple_grpo.generation.workers import place_worker  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="32,256", help="completion lengths in tokens, comma-separated")
    ap.add_argument("--block_sizes", default="128,32", help="vLLM KV-cache block sizes (multiples of 32 on a CPU)")
    ap.add_argument("--repeats", type=int, default=8, help="batches per length (the first is not counted)")
    ap.add_argument("--gen_compile", default="off", choices=["off", "on"], help="torch.compile vLLM's model")
    ap.add_argument("--batches", default="1", help="batches sampled in one vLLM call, comma-separated, e.g. 1,2,4")
    args = ap.parse_args()
    batches = [int(k) for k in args.batches.split(",")]
    if min(batches) < 1:
        raise SystemExit(f"--batches {args.batches}: each count must be 1 or more")
    if args.repeats < 2:
        raise SystemExit("--repeats must be at least 2: the first batch is not counted")
    cfg = SamplerConfig(model=os.path.join(ROOT, "models", "tiny-math"), max_model_len=512, num_generations=GROUP,
                 batch_prompts=PROMPTS, temperature=TEMPERATURE, gen_compile=args.gen_compile == "on",
                 dataset=os.path.join(ROOT, TRAIN))
    with contextlib.redirect_stdout(sys.stderr):  # worker 0's core and OpenMP settings, as in a run
        _, env, cores, _ = place_worker(cfg, 0)
    block_size = int(os.environ.get("BENCH_BLOCK_SIZE", "0"))
    if not block_size:  # the parent: a fresh process per block size, its OpenMP set up before it starts
        for size in args.block_sizes.split(","):
            child = subprocess.run([sys.executable, *sys.argv], env={**os.environ, **env, "BENCH_BLOCK_SIZE": size},
                                   check=True, stdout=subprocess.PIPE, text=True)
            for line in child.stdout.splitlines():  # vLLM logs to stdout too: those lines go to stderr
                print(line, file=sys.stdout if line.startswith('{"block_size"') else sys.stderr, flush=True)
        return
    os.sched_setaffinity(0, cores)
    # with --batches: room for the largest call in one engine for every k (max_num_seqs, as the full trainer sets it)
    llm = start_vllm(cfg, compile=cfg.gen_compile, block_size=block_size,
                     max_seqs=max(batches) * cfg.batch_prompts * cfg.num_generations if max(batches) > 1 else None)
    tokenizer, problems, rng = llm.get_tokenizer(), load_data(cfg), random.Random(0)
    stop_ids = stop_token_ids(tokenizer, cfg.prompt_format)
    for length in [1] + [int(x) for x in args.lengths.split(",")]:
        run_cfg = dataclasses.replace(cfg, max_new_tokens=length, min_new_tokens=length)
        for k in batches:
            times = []
            for _ in range(args.repeats):
                prompts = [make_prompt(tokenizer, p["question"], cfg.prompt_format, cfg.system_prompt)
                           for p in rng.sample(problems, k * cfg.batch_prompts)]
                t0 = time.time()
                sample(llm, prompts, run_cfg, stop_ids)
                times.append(time.time() - t0)
            call = statistics.median(times[1:])
            line = {"block_size": block_size, "completion_len": length, "gen_compile": cfg.gen_compile,
                    "s_per_batch": round(call / k, 4), "min_s": round(min(times[1:]) / k, 4),
                    "max_s": round(max(times[1:]) / k, 4), "completions": cfg.batch_prompts * cfg.num_generations}
            if args.batches != "1":
                line.update(batches_per_call=k, s_per_call=round(call, 4),
                            ms_per_token_step=round(1000 * call / length, 2))
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
