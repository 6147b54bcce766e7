"""From sampled completions to trainable groups: rewards, the groups kept, the step's rollout figures, the padded
batch. Q prompts, G completions each (Q*G rows, group after group), P prompt and C completion tokens.
"""
import torch

from grpo_math import group_advantages, groups_with_signal
from simple_grpo.generation.vllm_sampler import NO_LOGP
from simple_grpo.task.rewards import pick_accuracy_reward, score, true_answer


def score_groups(completions, problems, G, weights):
    """rewards (Q*G,) and the per-completion scores, for completions grouped by problem."""
    scores = [score(text, true_answer(problems[i // G]["answer"]), weights)
              for i, text in enumerate(completions)]
    return torch.tensor([s["reward"] for s in scores]), scores


def correct_rows(scores, weights):
    """(Q*G,) 1.0 where a completion earned the correctness reward trained on (pick_accuracy_reward): RAFT's."""
    name = pick_accuracy_reward(weights)
    return torch.tensor([float(s[name] == 1.0) for s in scores])


def make_groups(prompt_rows, completion_ids, until_stop, rewards, G, meta, sampler_logps=None, keep_equal=False,
                scale_rewards="group", scores=None, estimator="grpo", correct=None, eps=1e-4):
    """One group (tensors, meta) per prompt with a non-zero advantage (or keep_equal), and has_signal (Q,)."""
    advantages = group_advantages(rewards, G, scale_rewards=scale_rewards, eps=eps, estimator=estimator, correct=correct)
    has_signal = groups_with_signal(advantages, G)
    groups = []
    for q in torch.nonzero(has_signal | keep_equal).flatten().tolist():
        rows = slice(q * G, (q + 1) * G)
        C = int(until_stop[rows].sum(1).max())  # trim the group's common padding
        tensors = {"prompt_ids": prompt_rows[q], "completion_ids": completion_ids[rows, :C],
                   "rewards": rewards[rows].float(), "advantages": advantages[rows].float()}
        if sampler_logps is not None:
            tensors["sampler_logps"] = sampler_logps[rows, :C].float()
        groups.append((tensors, dict(meta, **({"scores": scores[rows]} if scores else {}))))
    return groups, has_signal


def rollout_stats(rewards, scores, until_stop, has_signal, gen_s, truncated, accuracy_reward="correctness"):
    """One step's rollout figures, dropped groups included; until_stop (Q*G, C), truncated (Q*G,)."""
    each = {}
    for name in (n for n in scores[0] if n != "reward"):  # each reward function's mean and spread
        values = torch.tensor([s[name] for s in scores], dtype=torch.float)
        each.update({f"reward_{name}": values.mean().item(), f"reward_{name}_std": values.std().item()})
    lengths = until_stop.sum(1)
    return {"reward_mean": rewards.mean().item(), "reward_std": rewards.std().item(), **each,
            "accuracy": sum(s[accuracy_reward] for s in scores) / len(scores),
            "format_rate": sum(s["format"] for s in scores) / len(scores),
            "completion_len": lengths.mean().item(), "completion_len_min": int(lengths.min()),
            "completion_len_max": int(lengths.max()), "truncated_frac": truncated.float().mean().item(),
            "zero_var_frac": 1 - has_signal.float().mean().item(),
            "tokens_per_s": until_stop.sum().item() / gen_s, "gen_s": gen_s}


def collate(groups, pad_id):
    """One batch from finished groups: one left-padded prompt row per group (Q, P), and the groups' completions
    right-padded, group after group (Q*G, C), with their per-token tensors (sampler_logps padded with NO_LOGP)."""
    P = max(g["prompt_ids"].numel() for g in groups)
    C = max(g["completion_ids"].size(1) for g in groups)
    per_token = [k for k in ("ref_logps", "sampler_logps") if all(k in g for g in groups)]  # beta 0: no ref_logps
    rows = {k: [] for k in ("prompt_ids", "prompt_mask", "completion_ids", "advantages", *per_token)}
    for g in groups:
        p, c = g["prompt_ids"], g["completion_ids"]
        rows["prompt_ids"].append(torch.cat([torch.full((P - p.numel(),), pad_id), p])[None])
        rows["prompt_mask"].append((torch.arange(P) >= P - p.numel()).long()[None])
        rows["completion_ids"].append(torch.nn.functional.pad(c, (0, C - c.size(1)), value=pad_id))
        for k in per_token:
            pad = NO_LOGP if k == "sampler_logps" else 0.0
            rows[k].append(torch.nn.functional.pad(g[k], (0, C - c.size(1)), value=pad))
        rows["advantages"].append(g["advantages"])
    return {k: torch.cat(v) for k, v in rows.items()}
