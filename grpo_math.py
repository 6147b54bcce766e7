"""The GRPO math, written once and imported by both trainers and the reference server.

For each prompt we sample a group of G completions, score them, and push up the
log-probability of the better-than-average ones (Shao et al. 2024, DeepSeekMath):

    A_i      = (r_i - mean(r_group)) / (std(r_group) + eps)                   group-relative advantage
    ratio_t  = exp(logp_t - old_logp_t)                                        importance ratio per token
    L_clip_t = -min(ratio_t * A, clip(ratio_t, 1 - epsilon, 1 + epsilon_high) * A)
    KL_t     = exp(ref_t - logp_t) - (ref_t - logp_t) - 1                     k3 estimator, >= 0
    loss     = mean over sequences of [ mean over completion tokens of (L_clip_t + beta * KL_t) ]
"""
import torch


class ChunkedLogProbs(torch.autograd.Function):
    """log softmax(logits / T)[token_ids] and its gradient, a few rows at a time.

    Forward keeps one row logsumexp per token; backward recomputes the softmax chunk by chunk:
    d logp_t / d logit_v = (1[v = t] - softmax_v) / T. No (N, V) temporary is ever whole. When
    the logits are an intermediate that nothing else reads (the lm_head output is: its backward
    needs its input and weight, not its output), the gradient is written over them, so it
    costs no new (N, V) tensor either."""

    @staticmethod
    def forward(ctx, logits, token_ids, temperature, chunk_rows):
        V = logits.size(-1)
        rows, ids = logits.reshape(-1, V), token_ids.reshape(-1, 1)
        lse = torch.empty(rows.size(0), device=logits.device)
        logps = torch.empty(rows.size(0), device=logits.device)
        for i in range(0, rows.size(0), chunk_rows):
            x = rows[i:i + chunk_rows].float() / temperature
            lse[i:i + chunk_rows] = torch.logsumexp(x, dim=-1)
            logps[i:i + chunk_rows] = x.gather(-1, ids[i:i + chunk_rows]).squeeze(-1) - lse[i:i + chunk_rows]
        ctx.save_for_backward(logits, token_ids, lse)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        ctx.overwrite = logits.grad_fn is not None and logits._base is None and logits.is_contiguous()
        return logps.view(token_ids.shape)

    @staticmethod
    def backward(ctx, grad_logps):
        logits, token_ids, lse = ctx.saved_tensors
        V, c = logits.size(-1), ctx.chunk_rows
        rows, ids = logits.reshape(-1, V), token_ids.reshape(-1, 1)
        grad = rows if ctx.overwrite else torch.empty_like(rows)
        g = grad_logps.reshape(-1, 1).float() / ctx.temperature
        for i in range(0, rows.size(0), c):
            x = rows[i:i + c].float() / ctx.temperature
            d = torch.exp(x - lse[i:i + c, None]).mul_(-g[i:i + c])  # -softmax * g / T
            d.scatter_add_(-1, ids[i:i + c], g[i:i + c])  # + 1[v = t] * g / T
            grad[i:i + c] = d
        return grad.view(logits.shape), None, None, None


def selective_log_softmax(logits, token_ids, temperature=1.0, chunk_rows=None):
    """log softmax(logits / temperature)[token_ids], (B, T, V), (B, T) -> (B, T).

    The memory-efficient torch path (ChunkedLogProbs): the full (B, T, V) log-softmax is never
    held in memory, forward or backward. Dividing by the sampling temperature makes these the
    log-probs of the distribution the tokens were drawn from."""
    chunk_rows = chunk_rows or max(1, (1 << 22) // logits.size(-1))  # ~4M logits (16 MB fp32) at a time
    return ChunkedLogProbs.apply(logits, token_ids, temperature, chunk_rows)


def prefill_prompts(model, prompt_ids, prompt_mask, copies):
    """Run each left-padded prompt once; the output keeps the last position's logits and a KV
    cache holding `copies` copies of each prompt, one per completion to come (group after group).
    Positions count real tokens only, as generation does."""
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=(prompt_mask.cumsum(1) - 1).clamp(min=0),
                use_cache=True, logits_to_keep=1)
    out.past_key_values.batch_repeat_interleave(copies)
    return out


def sequence_logps(model, prompt_ids, prompt_mask, completion_ids, temperature=1.0, impl="torch"):
    """Per-token log-probs of the completion tokens under `model`, (Q*G, C).

    prompt_ids (Q, P) are left-padded; completion_ids (Q*G, C) are right-padded, the G
    completions of each prompt one after another (G = 1 is a plain batch). The G
    completions of a group share their prompt, and the prompt is most of the tokens
    (~130 of ~150 here), so the prompt runs once and its KV cache is copied G times:
    the same numbers as one forward over prompt + completion, for a fraction of the work.
    Positions count real tokens only, as in generation, so the numbers match the sampler's."""
    Q, B, C = prompt_ids.size(0), completion_ids.size(0), completion_ids.size(1)
    if B % Q:
        raise ValueError(f"{B} completions for {Q} prompts: expected the same number per prompt")
    G = B // Q
    # 1. the prompts, once each; the last prompt logit predicts the first completion token
    out = prefill_prompts(model, prompt_ids, prompt_mask, G)
    logits = [out.logits.repeat_interleave(G, dim=0)]
    # 2. the completions on G copies of each prompt's cache; token t predicts token t+1
    if C > 1:
        mask = torch.cat([prompt_mask.repeat_interleave(G, dim=0), torch.ones_like(completion_ids)], dim=1)
        positions = prompt_mask.sum(1).repeat_interleave(G)[:, None] + torch.arange(C - 1, device=mask.device)
        logits.append(model(input_ids=completion_ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions,
                            past_key_values=out.past_key_values, use_cache=True).logits)
    if impl == "triton":  # one fused kernel per pass (triton_loss/), the same numbers
        from triton_loss import selective_log_softmax_triton
        return selective_log_softmax_triton(torch.cat(logits, dim=1), completion_ids, temperature)
    return selective_log_softmax(torch.cat(logits, dim=1), completion_ids, temperature)


def completion_mask(completion_ids, eos_token_id):
    """1 for tokens up to and including the first EOS, 0 after it, (B, C).

    By position, not by token id: EOS itself is trained even when pad == eos, and a
    completion cut off without EOS keeps all its tokens."""
    is_eos = completion_ids == eos_token_id
    T = completion_ids.size(1)
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], T, dtype=torch.long))
    return (torch.arange(T, device=completion_ids.device)[None, :] <= first_eos[:, None]).float()


def group_advantages(rewards, group_size, eps=1e-4):
    """(r - mean_group) / (std_group + eps) for rewards (B,) laid out group after group."""
    r = rewards.view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).view(-1)


def per_token_loss(logps, old_logps, ref_logps, advantages, beta, epsilon, epsilon_high):
    """The clipped surrogate plus beta * k3 KL, per token, with the ratio and the KL: (B, C) each."""
    A = advantages[:, None]
    ratio = torch.exp(logps - old_logps)
    clipped_ratio = ratio.clamp(1 - epsilon, 1 + epsilon_high)
    per_token = -torch.min(ratio * A, clipped_ratio * A)
    kl = torch.zeros_like(logps)
    if beta != 0.0:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1  # k3: unbiased for KL(policy || ref), always >= 0
        per_token = per_token + beta * kl
    return per_token, ratio, kl


def grpo_loss(logps, old_logps, ref_logps, advantages, completion_mask, *, beta=0.04,
              epsilon=0.2, epsilon_high=None, loss_type="grpo", impl="torch"):
    """The GRPO loss and its diagnostics. Shapes: (B, C) except advantages (B,).

    Argument names follow TRL's GRPOConfig. old_logps are the log-probs under the policy
    that sampled the tokens (logps.detach() when that policy is the current one: ratio 1,
    gradient -A * grad logp). ref_logps may be None when beta == 0. impl="triton" computes the
    per-token loss in one fused kernel (triton_loss/), with the same numbers."""
    if loss_type != "grpo":
        raise ValueError(f"unknown loss_type {loss_type!r}: this version has 'grpo'")
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    mask = completion_mask
    if impl == "triton":
        from triton_loss import per_token_loss_triton as per_token_fn
    else:
        per_token_fn = per_token_loss
    per_token, ratio, kl = per_token_fn(logps, old_logps, ref_logps, advantages, beta, epsilon, epsilon_high)
    A = advantages[:, None]
    # "grpo": average over each sequence's own tokens, then over sequences
    tokens = mask.sum(1).clamp(min=1)
    loss = ((per_token * mask).sum(1) / tokens).mean()

    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        was_clipped = ((ratio < 1 - epsilon) & (A < 0)) | ((ratio > 1 + epsilon_high) & (A > 0))
        stats = {"kl": ((kl * mask).sum() / n).item(),
                 "clip_fraction": ((was_clipped.float() * mask).sum() / n).item(),
                 "ratio_mean": ((ratio * mask).sum() / n).item()}
    return loss, stats
