"""bench/logprob_path.py: time of one update's log-prob pass, forward + backward, three ways, on the tiny model.

    python bench/logprob_path.py [--groups 7 --G 8 --C 32 --repeats 10 --threads 1]

  plain      plain_logps below: one forward over each row's prompt + completion (the prompt G times)
  grpo_math  grpo_math.completion_logps: each group's prompt once, its G completions on its KV cache, one
             log-softmax (what the lessons, grpo_train.py and grpo_vllm_one.py, and ref_server.py run)
  shared     simple_grpo.logprobs.sequence_logps: the same, the log-softmax a chunk of rows at a time (what the
             full trainer's grpo_update runs)
The batch is make demo's: groups of G completions of C tokens (the demo's median step trains ~7 groups of 8,
completions up to ~32 tokens) to the training set's first prompts (109-146 tokens), random completion tokens.
Both compute the entropy too, as the trainer does. Prints one JSON line per method (median and spread of the
seconds over --repeats, after one warm-up), then the largest difference from the plain method's log-probs.
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
from grpo_math import completion_logps  # noqa: E402
from simple_grpo.logprobs import sequence_logps  # noqa: E402
from simple_grpo.task.problems import load_jsonl, make_prompt  # noqa: E402


def demo_batch(tokenizer, groups, G, C):
    """prompt_ids (Q, P) left-padded with prompt_mask, completion_ids (Q*G, C) of random tokens."""
    prompts = [make_prompt(tokenizer, p["question"])
               for p in load_jsonl(os.path.join(ROOT, "data", "toy_math", "train.jsonl"))[:groups]]
    rows = [torch.tensor(ids) for ids in tokenizer(prompts)["input_ids"]]
    P = max(r.numel() for r in rows)
    prompt_ids = torch.stack([torch.cat([torch.full((P - r.numel(),), tokenizer.pad_token_id), r]) for r in rows])
    prompt_mask = torch.stack([(torch.arange(P) >= P - r.numel()).long() for r in rows])
    completion_ids = torch.randint(3, len(tokenizer), (groups * G, C), generator=torch.Generator().manual_seed(0))
    return prompt_ids, prompt_mask, completion_ids


def plain_logps(model, prompt_ids, prompt_mask, completion_ids, temperature=1.0):
    """One forward over each row's prompt + completion, log_softmax, gather; and the entropy."""
    G, P = completion_ids.size(0) // prompt_ids.size(0), prompt_ids.size(1)
    ids = torch.cat([prompt_ids.repeat_interleave(G, 0), completion_ids], 1)
    mask = torch.cat([prompt_mask.repeat_interleave(G, 0), torch.ones_like(completion_ids)], 1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                   use_cache=False).logits[:, P - 1:-1].float() / temperature
    all_logps = torch.log_softmax(logits, dim=-1)
    with torch.no_grad():
        entropy = -(all_logps.exp() * all_logps).sum(-1)
    return all_logps.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1), entropy


def timed(method, model, batch, repeats):
    """The log-probs of the last run and each run's seconds, forward + backward (one warm-up run first)."""
    seconds = []
    for _ in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        if method == "plain":
            logps, entropy = plain_logps(model, *batch)
        elif method == "grpo_math":
            logps, entropy = completion_logps(model, *batch)
        else:
            logps, entropy = sequence_logps(model, *batch, entropy=True)
        logps.sum().backward()
        seconds.append(time.perf_counter() - t0)
    return logps.detach(), seconds[1:]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=7)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--C", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the trainer's --threads default: 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model_dir = os.path.join(ROOT, "models", "tiny-math")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    batch = demo_batch(AutoTokenizer.from_pretrained(model_dir), args.groups, args.G, args.C)
    logps = {}
    for method in ("plain", "grpo_math", "shared"):
        logps[method], seconds = timed(method, model, batch, args.repeats)
        print(json.dumps({"method": method, "groups": args.groups, "G": args.G, "P": batch[0].size(1), "C": args.C,
                          "threads": args.threads, "median_s": round(statistics.median(seconds), 4),
                          "min_s": round(min(seconds), 4), "max_s": round(max(seconds), 4)}))
    print(json.dumps({f"max_abs_logp_difference_{m}": (logps["plain"] - logps[m]).abs().max().item()
                      for m in ("grpo_math", "shared")}))


if __name__ == "__main__":
    main()
