"""The pre-flight probe: will GRPO get a learning signal from this model, data and reward? Run by
tools/probe.py (its command line) and by the trainers' --preflight (preflight.py: in a process of its own).

Samples G completions for each of the first n problems with the STARTING model (vLLM, as
grpo_vllm_one.py samples), scores them with the training rewards, and prints what decides
whether GRPO can learn: how many prompts had 0, 1, ..., G correct completions, the reward
spread within each group, the format rate, completion length, the share of completions cut off
at --max_new_tokens, and the share of groups whose rewards are all alike (every advantage 0:
GRPO learns nothing from them). Then a verdict in plain words, and one last JSON line:
{"n", "G", "pass_rate_hist", "format_rate", "truncated_frac", "zero_var_frac", "mean_len", "verdict", ...}.
With --log_completions PATH it also writes a few groups in completions_log.py's format, with the trainer's
(transformers') per-token log-probs beside vLLM's.
"""
import json
import os
import time
from dataclasses import dataclass

import torch

from grpo_math import completion_mask, group_advantages, is_truncated
from simple_grpo.evaluation import context_length
from simple_grpo.flags import flag
from simple_grpo.generation.vllm_sampler import sample, start_vllm
from simple_grpo.logprobs import sequence_logps
from simple_grpo.rollouts import collate, make_groups, rollout_stats, score_groups
from simple_grpo.run.completions_log import completion_rows, log_completions, pick_groups
from simple_grpo.task.problems import TaskConfig, check_task, load_data, make_prompt, stop_token_ids
from simple_grpo.task.rewards import parse_reward_spec, pick_accuracy_reward

MOST = 0.5  # "most groups are all-alike" from this share on


@dataclass
class ProbeConfig(TaskConfig):
    n: int = flag(200, "probe the first n problems")
    dtype: str = flag("float32", "vLLM's dtype: float32 or bfloat16")
    max_model_len: int = flag(0, "vLLM's context (0: the longest prompt + max_new_tokens)")
    gen_tp: int = flag(1, "vLLM tensor-parallel size (GPUs)")
    gen_memory: float = flag(0.0, "vLLM's gpu_memory_utilization (0: 0.3)")
    log_completions: str = flag("", "also write a few groups to this completions.jsonl, for tools/view_run.py")
    log_groups: int = flag(4, "groups written by --log_completions")
    log_step: int = flag(0, "the step --log_completions tags rows with (a checkpoint's step: runs/NAME/step_N)")


# ---------------------------------------------------------------------------- setting up
def load_tokenizer(cfg):
    """The model's tokenizer; a missing local directory fails at once (not after the hub's retries)."""
    from transformers import AutoTokenizer
    parent = os.path.dirname(cfg.model)
    if not os.path.isdir(cfg.model) and (os.path.isabs(cfg.model) or cfg.model.startswith(".")
                                         or (parent and os.path.isdir(parent))):
        raise SystemExit(f"model directory {cfg.model} not found: give a model directory, e.g. models/tiny-math "
                         "(or a hub name)")
    try:
        return AutoTokenizer.from_pretrained(cfg.model)
    except (OSError, ValueError) as e:  # no such directory, or a name that is no hub repo
        raise SystemExit(f"model {cfg.model!r} not found ({str(e).splitlines()[0]}): give a model directory, "
                         "e.g. models/tiny-math, or a hub name that is downloaded or reachable") from None


def load_first_problems(cfg):
    try:
        problems = load_data(cfg)
    except (OSError, ValueError) as e:
        raise SystemExit(f"dataset {cfg.dataset!r}: {e}") from None
    return problems[:cfg.n]


def check_flags(cfg):
    """Reject bad values before the slow start-up."""
    if cfg.n < 1:
        raise SystemExit(f"--n must be at least 1, got {cfg.n}")
    check_task(cfg)


# ---------------------------------------------------------------------------- what the samples say
def correct_per_prompt(scores, G, accuracy_reward="correctness"):
    """How many of each prompt's G completions are correct (accuracy_reward > 0: correctness, or answer_is)."""
    return [sum(s[accuracy_reward] > 0 for s in scores[q * G:(q + 1) * G]) for q in range(len(scores) // G)]


def pass_rate_histogram(correct, G):
    """hist[k]: the prompts with exactly k correct completions, k = 0..G."""
    return [correct.count(k) for k in range(G + 1)]


def verdict(hist, rewards, zero_var_frac, truncated_frac, G):
    """The probe's conclusion in plain words. hist: pass_rate_histogram; rewards (Q*G,)."""
    n = sum(hist)
    by_group = rewards.view(-1, G)
    fix_reward = "change the reward (--reward_funcs/--reward_weights/--reward_file)"
    if zero_var_frac == 1.0:
        earned = int((by_group != 0).any(1).sum())
        if earned == 0:
            text = (f"0 of {n} prompts earned any reward: GRPO will get no signal; warm-start the model on the "
                    f"answer format (supervised: python tools/warm_start.py --model MODEL --out DIR), or {fix_reward}")
        else:
            text = (f"no group has reward variance (each prompt's {G} completions all scored alike): GRPO will get "
                    f"no signal; raise --num_generations or --temperature, or {fix_reward}")
    elif zero_var_frac >= MOST:
        why = f"of {n} prompts, {hist[0]} had no correct completion and {hist[G]} had all {G} correct"
        text = (f"most groups ({zero_var_frac:.0%}) are all-alike: GRPO learns from the other "
                f"{1 - zero_var_frac:.0%} only, and slowly ({why}); raise --num_generations, or pick problems "
                "nearer the model's level")
    else:
        text = f"healthy: {1 - zero_var_frac:.0%} of groups have reward variance"
        mixed = sum(hist[1:G]) / n  # prompts with correct and wrong completions: correctness teaches there
        if mixed < MOST:
            text += (f", but only {mixed:.0%} of prompts have both correct and wrong completions ({hist[0]} none "
                     f"correct, {hist[G]} all correct): the rest learn from the other rewards only")
    if truncated_frac >= MOST:
        text += (f". Most completions ({truncated_frac:.0%}) hit --max_new_tokens without a stop token: "
                 "raise --max_new_tokens, or the answers are cut short")
    return text


def print_report(cfg, correct, rewards, stats, truncated_frac):
    """The histogram, with the reward spread of each bin's groups, and the rates."""
    G, n = cfg.num_generations, len(correct)
    stds = rewards.view(-1, G).std(1).tolist()  # (Q,): 0 for a group GRPO learns nothing from
    print(f"\n{cfg.model} on {cfg.dataset}: {n} prompts x {G} completions, T={cfg.temperature}, "
          f"<= {cfg.max_new_tokens} tokens, rewards {cfg.reward_funcs} weighted {cfg.reward_weights}")
    print(f"{'correct':>8} {'prompts':>8} {'share':>7}  {'reward std in group (mean)':>26}")
    for k in range(G + 1):
        bin_stds = [std for c, std in zip(correct, stds) if c == k]
        mean_std = f"{sum(bin_stds) / len(bin_stds):.3f}" if bin_stds else "-"
        print(f"{k:>8} {len(bin_stds):>8} {len(bin_stds) / n:>7.1%}  {mean_std:>26}")
    print(f"reward std within a group: mean {sum(stds) / n:.3f}, median {sorted(stds)[n // 2]:.3f}; "
          f"reward mean {rewards.mean().item():.3f}")
    print(f"format rate {stats['format_rate']:.3f}, accuracy {stats['accuracy']:.3f}, mean completion length "
          f"{stats['completion_len']:.1f} tokens, truncated {truncated_frac:.1%}, groups with no reward variance "
          f"{stats['zero_var_frac']:.1%}; sampling took {stats['gen_s']:.1f} s ({stats['tokens_per_s']:.0f} tokens/s)")


# ---------------------------------------------------------------------------- logging a few groups
def trainer_logps(cfg, prompt_rows, completion_ids, questions, G, pad_id):
    """transformers' per-token log-probs (at cfg.temperature) of the completions of `questions`, (len * G, C)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=getattr(torch, cfg.dtype)).eval()
    groups = [{"prompt_ids": prompt_rows[q], "completion_ids": completion_ids[q * G:(q + 1) * G],
               "advantages": torch.zeros(G)} for q in questions]
    batch = collate(groups, pad_id)
    with torch.no_grad():
        return sequence_logps(model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                              cfg.temperature).float()


def write_completions(cfg, tokenizer, prompts, prompt_rows, completion_ids, sampler_logps, mask, rewards, scores):
    """A few groups, with vLLM's and the trainer's log-probs, to cfg.log_completions."""
    G = cfg.num_generations
    questions = sorted({i // G for i in pick_groups(rewards.tolist(), G, cfg.log_groups)})
    rows = [q * G + g for q in questions for g in range(G)]  # the picked groups' completions, (len * G,)
    logps = trainer_logps(cfg, prompt_rows, completion_ids, questions, G, tokenizer.pad_token_id)
    sampler, picked_mask = sampler_logps[rows], mask[rows]
    entries = completion_rows(tokenizer, [prompts[q] for q in questions], completion_ids[rows], picked_mask,
                              [scores[i] for i in rows], group_advantages(rewards, G)[rows], G,
                              logps=logps, sampler_logps=sampler, ratio=torch.exp(logps - sampler),
                              groups=len(questions))
    os.makedirs(os.path.dirname(os.path.abspath(cfg.log_completions)), exist_ok=True)
    log_completions(cfg.log_completions, cfg.log_step, entries)
    gap = ((logps - sampler).abs() * picked_mask).sum() / picked_mask.sum()
    print(f"wrote {len(entries)} completions to {cfg.log_completions} (trainer - vLLM log-prob gap: mean |gap| "
          f"{gap.item():.2e} per token)")


# ---------------------------------------------------------------------------- the probe
def probe(cfg):
    check_flags(cfg)
    weights = parse_reward_spec(cfg.reward_funcs, cfg.reward_weights)  # {name: weight}
    problems = load_first_problems(cfg)
    tokenizer = load_tokenizer(cfg)
    G = cfg.num_generations
    prompts = [make_prompt(tokenizer, p["question"], cfg.prompt_format, cfg.system_prompt) for p in problems]
    stop_ids = stop_token_ids(tokenizer, cfg.prompt_format)
    if not cfg.max_model_len:
        cfg.max_model_len = context_length(tokenizer, prompts, cfg.max_new_tokens, cfg.model)

    llm = start_vllm(cfg)
    t0 = time.time()
    prompt_rows, completion_ids, sampler_logps = sample(llm, prompts, cfg, stop_ids)
    gen_s = time.time() - t0
    mask = completion_mask(completion_ids, stop_ids)
    truncated = is_truncated(completion_ids, stop_ids)  # no stop token: cut off at max_new_tokens
    texts = tokenizer.batch_decode(completion_ids * mask.long() + tokenizer.pad_token_id * (1 - mask.long()),
                                   skip_special_tokens=True)
    rewards, scores = score_groups(texts, problems, G, weights)
    _, has_signal = make_groups(prompt_rows, completion_ids, mask, rewards, G, {})
    accuracy_reward = pick_accuracy_reward(weights)  # correctness, or answer_is when that is trained on
    stats = rollout_stats(rewards, scores, mask, has_signal, gen_s, truncated, accuracy_reward)

    correct = correct_per_prompt(scores, G, accuracy_reward)
    hist = pass_rate_histogram(correct, G)
    truncated_frac = stats["truncated_frac"]
    print_report(cfg, correct, rewards, stats, truncated_frac)
    if cfg.log_completions:
        write_completions(cfg, tokenizer, prompts, prompt_rows, completion_ids, sampler_logps, mask, rewards, scores)
    result = {"n": len(problems), "G": G, "pass_rate_hist": hist, "format_rate": round(stats["format_rate"], 4),
              "truncated_frac": round(truncated_frac, 4), "zero_var_frac": round(stats["zero_var_frac"], 4),
              "mean_len": round(stats["completion_len"], 2), "accuracy": round(stats["accuracy"], 4),
              "reward_mean": round(stats["reward_mean"], 4), "gen_s": round(gen_s, 1),
              "verdict": verdict(hist, rewards, stats["zero_var_frac"], truncated_frac, G)}
    print(f"\nverdict: {result['verdict']}")
    print(json.dumps(result), flush=True)
    return result
