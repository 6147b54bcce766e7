"""The GRPO math, written once: grpo_train.py, grpo_vllm_one.py, ref_server.py and the full trainer import it.

For each prompt we sample a group of G completions, score them, and push up the log-probability of the
better-than-average ones (Shao et al. 2024, DeepSeekMath):

    A_i      = (r_i - mean(r_group)) / (std(r_group) + eps)                   group-relative; std: N-1
    ratio_t  = exp(logp_t - old_logp_t)                                        importance ratio per token
    w_t      = min(exp(old_logp_t - vllm_logp_t), tis_cap)                     where vLLM sampled (TIS)
    L_clip_t = -w_t * min(ratio_t * A, clip(ratio_t, 1 - epsilon, 1 + epsilon_high) * A)
    KL_t     = exp(ref_t - logp_t) - (ref_t - logp_t) - 1                     k3 estimator, >= 0
    loss     = mean over sequences of [ mean over completion tokens of (L_clip_t + beta * KL_t) ]

old_logp is pi_old, the trainer's own log-probs before the step (ratio_t is 1: only its gradient counts).
grpo_objective is that loss in a dozen lines; grpo_loss is the same number, with later papers' variants as
options (TRL's names). Shapes: Q prompts, G completions each, B = Q*G rows, P and C prompt and completion
tokens, V the vocabulary.
"""
import torch


# ---------------------------------------------------------------------------- GRPO in one function
def grpo_objective(logps, old_logps, ref_logps, rewards, loss_mask, G, sampler_logps=None, beta=0.04, epsilon=0.2,
                   tis_cap=2.0):
    """The GRPO loss, term by term (tests/test_grpo_math.py: equal to grpo_loss's default).
    logps, old_logps, ref_logps, loss_mask, sampler_logps: (B, C) per completion token; rewards: (B,).
    sampler_logps: vLLM's log-probs (grpo_vllm_one.py), None where the policy sampled itself."""
    r = rewards.view(-1, G)                                                           # (Q, G)
    advantage = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1, 1)  # (B, 1)
    ratio = torch.exp(logps - old_logps)                                              # pi / pi_old, per token
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon)                            # the trust region
    surrogate = torch.min(ratio * advantage, clipped * advantage)                     # PPO's pessimistic bound
    if sampler_logps is not None:                                                     # capped importance weight
        surrogate = surrogate * torch.exp(old_logps - sampler_logps).clamp(max=tis_cap).detach()
    d = ref_logps - logps
    kl = torch.exp(d) - d - 1                                                         # KL to the reference (k3)
    per_token = -(surrogate - beta * kl)                                              # maximise A, stay near ref
    per_completion = (per_token * loss_mask).sum(1) / loss_mask.sum(1).clamp(min=1)  # mean over its tokens
    return per_completion.mean()                                                      # mean over completions


# ---------------------------------------------------------------------------- log-probs
def completion_logps(model, prompt_ids, prompt_mask, completion_ids, temperature=1.0):
    """log pi(token | the tokens before it) of each completion token, and each position's entropy (a
    diagnostic), (B, C) each, under softmax(logits / temperature), the samplers' distribution. prompt_ids
    (Q, P) left-padded with prompt_mask; completion_ids (B, C) right-padded. Each prompt runs once and its KV
    cache serves its G completions (with gradient checkpointing, which keeps none, one forward over both)."""
    (Q, P), (B, C) = prompt_ids.shape, completion_ids.shape
    G = B // Q
    attention_mask = torch.cat([prompt_mask.repeat_interleave(G, 0), torch.ones_like(completion_ids)], 1)  # (B, P+C)
    module = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    if module.training and getattr(module, "is_gradient_checkpointing", False):
        ids = torch.cat([prompt_ids.repeat_interleave(G, 0), completion_ids], 1)               # (B, P + C)
        positions = (attention_mask.cumsum(1) - 1).clamp(min=0)   # count real tokens only, as generation does
        logits = model(input_ids=ids, attention_mask=attention_mask, position_ids=positions,
                       use_cache=False).logits[:, P - 1:-1]       # (B, C, V): position P-1+t predicts token t
    else:
        prompt = model(input_ids=prompt_ids, attention_mask=prompt_mask, use_cache=True, logits_to_keep=1,
                       position_ids=(prompt_mask.cumsum(1) - 1).clamp(min=0))  # each prompt once: (Q, 1, V)
        prompt.past_key_values.batch_repeat_interleave(G)        # its cache, G copies: B rows
        logits = [prompt.logits.repeat_interleave(G, 0)]          # (B, 1, V): predicts completion token 0
        if C > 1:  # completion token t predicts token t + 1
            starts = prompt_mask.sum(1).repeat_interleave(G)[:, None]                       # (B, 1)
            positions = starts + torch.arange(C - 1, device=prompt_mask.device)            # (B, C - 1)
            logits.append(model(input_ids=completion_ids[:, :-1], attention_mask=attention_mask[:, :-1],
                                position_ids=positions, past_key_values=prompt.past_key_values,
                                use_cache=True).logits)           # (B, C - 1, V)
        logits = torch.cat(logits, 1)                             # (B, C, V)
    all_logps = torch.log_softmax(logits.float() / temperature, dim=-1)                    # (B, C, V)
    logps = all_logps.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)                 # (B, C)
    with torch.no_grad():
        entropy = -(all_logps.exp() * all_logps).sum(-1)                                   # (B, C)
    return logps, entropy


def stop_positions(completion_ids, stop_ids, lengths=None):
    """Where each row ends, (B,): at its first stop token, or else at its last generated token (lengths (B,):
    the tokens the sampler generated; None: every position); and whether it ended at a stop token, (B,)."""
    B, C = completion_ids.shape
    positions = torch.arange(C, device=completion_ids.device)[None, :]                      # (1, C)
    lengths = torch.full((B,), C, device=completion_ids.device) if lengths is None else lengths.to(completion_ids.device)
    is_stop = torch.isin(completion_ids, torch.as_tensor(stop_ids, device=completion_ids.device))
    is_stop &= positions < lengths[:, None]            # the padding past a row's end is no stop, even if pad == EOS
    stopped = is_stop.any(1)
    return torch.where(stopped, is_stop.int().argmax(1), lengths - 1), stopped


def is_truncated(completion_ids, stop_ids, lengths=None):
    """True for each row cut off with no stop token, (B,)."""
    return ~stop_positions(completion_ids, stop_ids, lengths)[1]


# ---------------------------------------------------------------------------- masks and advantages
def completion_mask(completion_ids, stop_ids, mask_truncated=False, lengths=None):
    """1 for each token up to and including its row's first stop token, 0 after it and past lengths, (B, C).
    By position, not token id: EOS is trained even when pad == EOS. A row cut off with no stop token keeps its
    tokens, unless mask_truncated (DAPO: an answer cut off was not judged on its merits): then none."""
    last, stopped = stop_positions(completion_ids, stop_ids, lengths)
    mask = (torch.arange(completion_ids.size(1), device=completion_ids.device)[None, :] <= last[:, None]).float()
    return mask * stopped[:, None] if mask_truncated else mask


ADVANTAGE_ESTIMATORS = ("grpo", "raft")


def group_advantages(rewards, group_size, *, scale_rewards="group", eps=1e-4, estimator="grpo", correct=None):
    """A = r - mean_group over a std: the group's ("group", GRPO), the batch's ("batch") or none ("none",
    Dr. GRPO). rewards (B,), group after group; equal rewards give A = 0 / (0 + eps) = 0. Estimator "raft"
    (RAFT): A = 1 for each correct completion (correct (B,): 1 where correct), 0 for the rest."""
    r = rewards.view(-1, group_size)
    if estimator == "raft":
        if correct is None:
            raise ValueError("the raft estimator keeps the correct completions: pass correct, 1 for each")
        return (correct.to(rewards.device) == 1).float().view(-1)
    if estimator != "grpo":
        raise ValueError(f"unknown advantage estimator {estimator!r}: use one of {', '.join(ADVANTAGE_ESTIMATORS)}")
    centred = r - r.mean(1, keepdim=True)
    if scale_rewards == "group":
        centred = centred / (r.std(1, keepdim=True) + eps)
    elif scale_rewards == "batch":
        centred = centred / (rewards.std() + eps)
    elif scale_rewards != "none":
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}: use 'group', 'batch' or 'none'")
    return centred.view(-1)


def groups_with_signal(advantages, group_size):
    """(Q,) True for a group with an advantage other than 0; the others add no policy gradient."""
    return (advantages.view(-1, group_size) != 0).any(1)


# ---------------------------------------------------------------------------- the loss with all its options
def kl_estimate(logps, ref_logps, estimator="k3"):
    """Per-token estimates of KL(policy || ref) (Schulman 2020), d = ref - logp: k1 = -d, k2 = d^2 / 2,
    k3 = exp(d) - d - 1 (unbiased and >= 0: GRPO's)."""
    d = ref_logps - logps
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(d) - d - 1
    raise ValueError(f"unknown kl_estimator {estimator!r}: use 'k1', 'k2' or 'k3'")


def importance_ratio(logps, old_logps, loss_mask, level="token"):
    """exp(logp - old_logp) per token (B, C), or at level "sequence" (GSPO) one per row, (B, 1), from the mean
    of logp - old_logp over its tokens."""
    log_ratio = logps - old_logps
    if level == "token":
        return torch.exp(log_ratio)
    if level == "sequence":
        return torch.exp((log_ratio * loss_mask).sum(1, keepdim=True) / loss_mask.sum(1, keepdim=True).clamp(min=1))
    raise ValueError(f"unknown importance_sampling_level {level!r}: use 'token' or 'sequence'")


def per_token_loss(logps, old_logps, ref_logps, advantages, beta, epsilon, epsilon_high, *, loss_mask=None,
                   loss_type="grpo", importance_sampling_level="token", kl_estimator="k3"):
    """The policy-gradient term plus beta * KL per token, the ratio and the KL, (B, C) each. The term is
    -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A); cispo's (MiniMax-M1) is
    -sg(min(ratio, 1 + epsilon_high)) * A * logp, so no token's gradient is clipped away."""
    A = advantages[:, None]
    if loss_mask is None:
        loss_mask = torch.ones_like(logps)
    ratio = importance_ratio(logps, old_logps, loss_mask, importance_sampling_level)
    if loss_type == "cispo":
        per_token = -ratio.clamp(max=1 + epsilon_high).detach() * A * logps
    else:
        per_token = -torch.min(ratio * A, ratio.clamp(1 - epsilon, 1 + epsilon_high) * A)
    kl = torch.zeros_like(logps)
    if beta != 0.0:
        kl = kl_estimate(logps, ref_logps, kl_estimator)
        per_token = per_token + beta * kl
    return per_token, ratio.expand_as(logps), kl


LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")


def loss_denominator(loss_mask, loss_type="grpo", max_completion_length=None):
    """What a loss type divides its sum by, counted on the batch: (B, C) loss_mask -> a number.
      grpo:              sequences (each sequence's mean over its tokens is summed: a token of a short
                         answer weighs more than one of a long answer)
      bnpo, dapo, cispo: completion tokens (every token weighs the same)
      dr_grpo:           sequences * max_completion_length (a constant: no length bias; Liu et al. 2025)
    A trainer that splits the batch divides every part's sum by the WHOLE batch's count: the parts' gradients
    then add up to the whole batch's, whichever part a group lands in. The token count is the raw one (0 where
    masking kept no token): clamp it to 1 once the parts' counts are added up, not each part's."""
    if loss_type == "grpo":
        return loss_mask.size(0)
    if loss_type in ("bnpo", "dapo", "cispo"):
        return loss_mask.sum()
    if loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("loss_type dr_grpo needs max_completion_length")
        return loss_mask.size(0) * max_completion_length
    raise ValueError(f"unknown loss_type {loss_type!r}: use one of {', '.join(LOSS_TYPES)}")


def aggregate(per_token, loss_mask, loss_type="grpo", max_completion_length=None, denominator=None):
    """The per-token losses' sum (grpo: of each row's token mean) over loss_denominator, or over
    `denominator`, the whole batch's, where these rows are a part of it."""
    if denominator is None:  # the batch is whole here; one that keeps no token sums to 0 and divides by 1
        denominator = torch.as_tensor(loss_denominator(loss_mask, loss_type, max_completion_length)).clamp(min=1)
    if loss_type == "grpo":
        return ((per_token * loss_mask).sum(1) / loss_mask.sum(1).clamp(min=1)).sum() / denominator
    return (per_token * loss_mask).sum() / denominator


def capped_is_weight(old_logps, sampler_logps, cap):
    """TIS: another sampler (vLLM: other kernels, older weights) drew the tokens, so each token's
    policy-gradient term is weighted by min(pi_old / pi_sampler, cap), detached: the clip sees pi / pi_old."""
    return torch.exp(old_logps - sampler_logps).clamp(max=cap).detach()


def grpo_loss(logps, old_logps, ref_logps, advantages, loss_mask, *, beta=0.04, epsilon=0.2,
              epsilon_high=None, loss_type="grpo", importance_sampling_level="token", kl_estimator="k3",
              max_completion_length=None, impl="torch", sampler_logps=None, tis_cap=2.0, denominator=None):
    """The GRPO loss and its diagnostics; inputs (B, C) but advantages (B,). loss_mask: 1 for the tokens the
    loss counts; ref_logps may be None when beta == 0; sampler_logps: another sampler's (capped_is_weight);
    denominator: see aggregate. impl="triton": the clipped token-level k3 loss in one fused kernel."""
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    # a masked position may hold anything (-inf: inf x 0 is NaN), so every input is 0 there
    keep = loss_mask.bool()
    logps, old_logps = logps.masked_fill(~keep, 0.0), old_logps.masked_fill(~keep, 0.0)
    ref_logps = ref_logps.masked_fill(~keep, 0.0) if ref_logps is not None else None
    sampler_logps = sampler_logps.masked_fill(~keep, 0.0) if sampler_logps is not None else None
    if impl == "triton" and loss_type != "cispo" and importance_sampling_level == "token" and kl_estimator == "k3":
        from triton_loss import per_token_loss_triton
        per_token, ratio, kl = per_token_loss_triton(logps, old_logps, ref_logps, advantages, beta, epsilon,
                                                     epsilon_high)
    else:
        per_token, ratio, kl = per_token_loss(logps, old_logps, ref_logps, advantages, beta, epsilon, epsilon_high,
                                              loss_mask=loss_mask, loss_type=loss_type, kl_estimator=kl_estimator,
                                              importance_sampling_level=importance_sampling_level)
    if sampler_logps is not None:
        is_weight = capped_is_weight(old_logps, sampler_logps, tis_cap)
        per_token = is_weight * (per_token - beta * kl) + beta * kl  # the KL term is the trainer's own
    loss = aggregate(per_token, loss_mask, loss_type, max_completion_length, denominator)

    with torch.no_grad():
        n, A = loss_mask.sum().clamp(min=1), advantages[:, None]

        def mean(x):  # over the tokens the loss counts
            return ((x * loss_mask).sum() / n).item()

        # tokens whose gradient the clip removed (cispo: every token above 1 + epsilon_high)
        high = ratio > 1 + epsilon_high
        clipped_low = (ratio < 1 - epsilon) & (A < 0) if loss_type != "cispo" else torch.zeros_like(high)
        clipped_high = high if loss_type == "cispo" else high & (A > 0)
        stats = {"kl": mean(kl), "clip_fraction": mean(clipped_low | clipped_high), "clip_low_frac": mean(clipped_low),
                 "clip_high_frac": mean(clipped_high), "ratio_mean": mean(ratio)}
        if sampler_logps is not None:
            stats.update(is_weight_mean=mean(is_weight), is_capped_frac=mean(is_weight >= tis_cap))  # TIS's names
        if keep.any():  # the extremes over the tokens the loss counts
            stats.update(ratio_min=ratio[keep].min().item(), ratio_max=ratio[keep].max().item())
            if sampler_logps is not None:
                stats.update(is_weight_min=is_weight[keep].min().item(), is_weight_max=is_weight[keep].max().item())
    return loss, stats
