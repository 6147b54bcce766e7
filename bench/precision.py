"""How far vLLM's log-probs are from the trainer's, per token, and what the update does with the gap.

    python bench/precision.py --model .cache/models/SmolLM2-135M-Instruct --dtype bfloat16
    python bench/precision.py --dtype float32                  # the tiny default model

vLLM samples Q prompts x G completions with the starting weights; the trainer's model (transformers,
same weights, same dtype) computes the same tokens' log-probs. Both are the same policy, so every
difference is numeric. Then one GRPO gradient on that batch, three ways:
  exact     fp32 trainer, its own log-probs as the old policy's (the gradient the samples call for)
  no_tis    the dtype's trainer, vLLM's log-probs as the old policy's (--tis_cap 0): the PPO clip
            sees the numeric gap as a policy change and drops tokens
  tis       the dtype's trainer, its own log-probs as the old policy's, each token weighted by
            min(pi_trainer / pi_vllm, cap) (the default, --tis_cap 2)
and the cosine of each with the exact one. Advantages are +-1 at random: the clip acts on their sign.
Prints a table and one JSON line.
"""
import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from simple_grpo.task.problems import make_prompt, stop_token_ids  # noqa: E402
from grpo_math import completion_mask, grpo_loss  # noqa: E402
from simple_grpo.logprobs import sequence_logps  # noqa: E402
from simple_grpo.rollouts import collate  # noqa: E402
from simple_grpo.task.problems import load_data  # noqa: E402
from bench.harness import SamplerConfig  # noqa: E402
from simple_grpo.generation.vllm_sampler import sample, start_vllm  # noqa: E402


def gradient(model, batch, mask, temperature, old_from_sampler, tis_cap):
    """The flattened gradient of the GRPO loss on `batch`, and the loss's diagnostics."""
    t0 = time.time()
    model.zero_grad()
    logps = sequence_logps(model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], temperature)
    sampler = batch["sampler_logps"]
    if old_from_sampler:
        loss, stats = grpo_loss(logps, sampler, None, batch["advantages"], mask, beta=0.0)
    else:
        loss, stats = grpo_loss(logps, logps.detach(), None, batch["advantages"], mask, beta=0.0,
                                sampler_logps=None if tis_cap == 0 else sampler, tis_cap=tis_cap)
    loss.backward()
    print(f"gradient in {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    return torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None]), stats


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "tiny-math"))
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--max_new_tokens", type=int, default=32)
    ap.add_argument("--tis_cap", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    cfg = SamplerConfig(model=args.model, dtype=args.dtype, num_generations=args.generations,
                 max_new_tokens=args.max_new_tokens, seed=args.seed, dataset=os.path.join(ROOT, SamplerConfig.dataset))
    llm = start_vllm(cfg)
    tokenizer = llm.get_tokenizer()
    stop_ids = stop_token_ids(tokenizer, cfg.prompt_format)
    problems = load_data(cfg)[:args.prompts]
    prompts = [make_prompt(tokenizer, p["question"], cfg.prompt_format, cfg.system_prompt) for p in problems]
    t0 = time.time()
    prompt_rows, completion_ids, sampler_logps = sample(llm, prompts, cfg, stop_ids)
    print(f"vLLM sampled {completion_ids.size(0)} completions in {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    del llm
    G = args.generations
    signs = torch.randint(0, 2, (completion_ids.size(0),), generator=torch.Generator().manual_seed(args.seed)) * 2 - 1
    groups = [{"prompt_ids": prompt_rows[q], "completion_ids": completion_ids[q * G:(q + 1) * G],
               "sampler_logps": sampler_logps[q * G:(q + 1) * G], "advantages": signs[q * G:(q + 1) * G].float()}
              for q in range(len(prompt_rows))]
    batch = collate(groups, tokenizer.pad_token_id)
    mask = completion_mask(batch["completion_ids"], stop_ids)

    from transformers import AutoModelForCausalLM
    results = {"model": os.path.basename(os.path.normpath(args.model)), "dtype": args.dtype,
               "tokens": int(mask.sum())}
    exact_model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    exact, _ = gradient(exact_model, batch, mask, cfg.temperature, False, 0)
    del exact_model
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    with torch.no_grad():
        logps = sequence_logps(model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                               cfg.temperature).float()
    gap = (logps - batch["sampler_logps"]).abs()[mask.bool()]
    results.update(gap_mean=gap.mean().item(), gap_max=gap.max().item(), gap_p99=gap.quantile(0.99).item())
    for name, from_sampler, cap in (("no_tis", True, 0), ("tis", False, args.tis_cap)):
        g, stats = gradient(model, batch, mask, cfg.temperature, from_sampler, cap)
        results[name] = {"clip_fraction": stats["clip_fraction"],
                         "cosine_to_exact": torch.nn.functional.cosine_similarity(g.double(), exact.double(), dim=0).item(),
                         **{k: stats[k] for k in ("is_weight_mean", "is_capped_frac") if k in stats}}

    print(f"\n{results['model']}, {args.dtype}: {results['tokens']} completion tokens, vLLM vs trainer |logp gap| "
          f"mean {results['gap_mean']:.2e}, p99 {results['gap_p99']:.2e}, max {results['gap_max']:.2e}")
    print(f"{'':10}{'clipped':>10}{'cos(exact)':>12}{'IS weight':>11}{'truncated':>11}")
    for name in ("no_tis", "tis"):
        r = results[name]
        print(f"{name:10}{r['clip_fraction']:>10.4f}{r['cosine_to_exact']:>12.4f}"
              f"{r.get('is_weight_mean', float('nan')):>11.4f}{r.get('is_capped_frac', float('nan')):>11.4f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
