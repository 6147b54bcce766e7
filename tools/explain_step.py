"""One GRPO step on the tiny model, printed as a lesson: what each number in the loss is.

    python tools/explain_step.py                 # a prompt of the toy task, G = 6, on CPU in seconds
    python tools/explain_step.py --seed 3 --num_generations 8 --lr 1e-4

It runs the trainers' own functions in one process (no reference server: the reference is a
frozen copy of the starting model): sample G completions of one prompt, score them, turn the
rewards into group-relative advantages, compute the GRPO loss token by token for one completion,
take one Adam step, and show how far the weights and that completion's probabilities moved.
"""
import copy
import os
import sys
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# noqa: E402 below - these imports come after the path fix that lets the script import them
from simple_grpo.task.rewards import parse_reward_spec  # noqa: E402
from simple_grpo.flags import flag, parse_flags  # noqa: E402
from grpo_math import completion_mask, group_advantages, grpo_loss, kl_estimate  # noqa: E402
from simple_grpo.logprobs import sequence_logps  # noqa: E402
from simple_grpo.generation.hf_sampler import generate  # noqa: E402
from simple_grpo.rollouts import score_groups  # noqa: E402
from simple_grpo.task.problems import TaskConfig, check_task, load_data, make_prompt, stop_token_ids  # noqa: E402


@dataclass
class ExplainConfig(TaskConfig):
    num_generations: int = flag(6, "completions of the prompt: the group size G")
    problem: int = flag(0, "which problem of the dataset to prompt with")
    beta: float = flag(0.04, "weight of the KL penalty to the reference")
    epsilon: float = flag(0.2, "PPO clip range")
    lr: float = flag(1e-4, "Adam's learning rate for the one step (the tiny model's)")


def show_tokens(tokenizer, ids, columns):
    """One row per token: the token, then each column's value at it."""
    print(f"  {'token':>14} " + " ".join(f"{name:>10}" for name in columns))
    for t, token_id in enumerate(ids):
        print(f"  {tokenizer.decode([token_id])!r:>14} " + " ".join(f"{v[t]:>10.4f}" for v in columns.values()))


def main(cfg):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    check_task(cfg)
    reward_weights = parse_reward_spec(cfg.reward_funcs, cfg.reward_weights)
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    policy = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    G, problem = cfg.num_generations, load_data(cfg)[cfg.problem]
    stop_ids = stop_token_ids(tokenizer, cfg.prompt_format)

    print(f"1. THE PROMPT ({'chat template applied' if cfg.prompt_format == 'chat' else 'raw text'})\n")
    prompt = make_prompt(tokenizer, problem["question"], cfg.prompt_format, cfg.system_prompt)
    print(prompt, f"\n(true answer: {problem['answer'].split('####')[-1].strip()})\n")

    print(f"2. G = {G} COMPLETIONS, sampled at temperature {cfg.temperature}, and their rewards\n")
    prompt_ids, prompt_mask, completion_ids = generate(policy, tokenizer, [prompt], cfg, stop_ids)
    mask = completion_mask(completion_ids, stop_ids)  # (G, C): 1 up to and including the stop token
    texts = tokenizer.batch_decode(completion_ids * mask.long() + tokenizer.pad_token_id * (1 - mask.long()),
                                   skip_special_tokens=True)
    rewards, scores = score_groups(texts, [problem], G, reward_weights)

    print("3. GROUP-RELATIVE ADVANTAGES: A_i = (r_i - mean r) / (std r + 1e-4), no value network\n")
    advantages = group_advantages(rewards, G)
    print(f"  rewards mean {rewards.mean():.3f}, std {rewards.std():.3f}\n")
    for i, text in enumerate(texts):
        parts = ", ".join(f"{name} {scores[i][name]:g}" for name in reward_weights)  # the reward's parts
        print(f"  [{i}] reward {rewards[i]:.2f} ({parts})  advantage {advantages[i]:+.3f}  {text!r}")
    if rewards.std() == 0:
        print("\n  every completion scored the same: every advantage is 0 and GRPO learns nothing from this group"
              " (the trainers drop it). Try another --seed or --problem.")
        return

    print("\n4. THE LOSS, TOKEN BY TOKEN, for the completion with the largest |advantage|\n")
    logps = sequence_logps(policy, prompt_ids, prompt_mask, completion_ids, cfg.temperature)  # (G, C)
    with torch.no_grad():
        ref_logps = sequence_logps(reference, prompt_ids, prompt_mask, completion_ids, cfg.temperature)
    old_logps = logps.detach()  # the policy that sampled is this one: ratio 1 on this first step
    i = int(advantages.abs().argmax())
    n = int(mask[i].sum())
    ratio = torch.exp(logps - old_logps)[i, :n].detach()
    kl = kl_estimate(logps, ref_logps)[i, :n].detach()
    policy_term = (-ratio * advantages[i])  # -min(ratio A, clip(ratio) A) = -ratio A while ratio is in the range
    show_tokens(tokenizer, completion_ids[i, :n].tolist(),
                {"logp": logps[i, :n].detach(), "ratio": ratio, "KL k3": kl, "-ratio*A": policy_term,
                 "+beta*KL": cfg.beta * kl})
    print("\n  on the first step the policy IS the sampler and the reference: ratio 1 and KL 0 at every token, so")
    print(f"  the gradient is -A * grad logp: the tokens of completion [{i}] are pushed "
          f"{'up' if advantages[i] > 0 else 'down'} (A = {advantages[i]:+.3f})")

    loss, stats = grpo_loss(logps, old_logps, ref_logps, advantages, mask, beta=cfg.beta, epsilon=cfg.epsilon)
    print(f"\n  loss = mean over completions of (mean over each one's tokens) = {loss.item():+.5f}"
          f"   (kl {stats['kl']:.5f}, clip fraction {stats['clip_fraction']:.3f})")
    print("  (its value is ~0 by construction: advantages sum to 0 within a group; its gradient is not)")

    print(f"\n5. ONE ADAM STEP, lr {cfg.lr:g}\n")
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm=float("inf"))
    before = [p.detach().clone() for p in policy.parameters()]
    optimizer.step()
    moved = torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in zip(policy.parameters(), before)))
    size = torch.sqrt(sum((b ** 2).sum() for b in before))
    print(f"  gradient norm {grad_norm:.4f}; the weights moved by {moved:.4f} (L2), {moved / size:.2e} of their norm")

    with torch.no_grad():
        new_logps = sequence_logps(policy, prompt_ids, prompt_mask, completion_ids, cfg.temperature)
    new_ratio = torch.exp(new_logps - old_logps)
    print("\n6. WHAT MOVED: each completion's probability ratio pi_new / pi_old (mean over its tokens), and KL\n")
    for j in range(G):
        m = mask[j].bool()
        print(f"  [{j}] advantage {advantages[j]:+.3f}  ratio {new_ratio[j][m].mean():.4f}  "
              f"KL {kl_estimate(new_logps, ref_logps)[j][m].mean():.6f}")
    print("\n  completions with A > 0 became more likely (ratio > 1), those with A < 0 less likely; on the next step")
    print("  the ratio is no longer 1, the clip to [1 - epsilon, 1 + epsilon] bounds how far one batch can push,")
    print("  and the KL term starts pulling the policy back towards the reference.")


if __name__ == "__main__":
    main(parse_flags(ExplainConfig, __doc__))
