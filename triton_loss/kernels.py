"""The Triton kernels and the autograd Functions around them (see README.md here).

1. Log-prob of the taken token, straight from the logits: one program per row streams the
   vocabulary in blocks and keeps a running max and sum of exp (online logsumexp), in fp32
   whatever the logits' dtype; backward streams the row again and writes
   d logp / d logit_v = (1[v = t] - softmax_v) * g / T, over the logits when nothing else reads them.
2. The per-token GRPO loss: clipped surrogate, k3 KL, and the loss's derivative with respect to
   logp, all in one elementwise pass; backward is one multiply.
The plain torch versions (grpo_math.py) give the same numbers; tests/test_triton_loss.py checks it.
"""
import torch
import triton
import triton.language as tl

# No fused multiply-add in the log-prob kernels: fma(x, 1/T, -m) keeps the exact product where m
# holds it rounded, so the largest logit would no longer cancel itself exactly: at logits of 1e4
# on an H100 that moved a log-prob of ~0 to -3e-4. Separately rounded, the kernel gives torch's numbers.
NO_FMA = {"enable_fp_fusion": False}


@triton.jit
def _logp_forward(logits_ptr, ids_ptr, logps_ptr, lse_ptr, V, inv_temperature, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    start = logits_ptr + row.to(tl.int64) * V
    cols = tl.arange(0, BLOCK)
    # the first block, then the rest: running max m and sum s of exp(x - m)
    x = tl.load(start + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_temperature
    m = tl.max(x, 0)
    s = tl.sum(tl.exp(x - m), 0)
    for block in range(BLOCK, V, BLOCK):
        x = tl.load(start + block + cols, mask=block + cols < V, other=float("-inf")).to(tl.float32) * inv_temperature
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    token = tl.load(ids_ptr + row)
    taken = tl.load(start + token).to(tl.float32) * inv_temperature
    tl.store(logps_ptr + row, taken - lse)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _logp_backward(logits_ptr, grad_ptr, ids_ptr, lse_ptr, dlogps_ptr, V, inv_temperature, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offset = row.to(tl.int64) * V
    g = tl.load(dlogps_ptr + row) * inv_temperature
    lse = tl.load(lse_ptr + row)
    token = tl.load(ids_ptr + row)
    cols = tl.arange(0, BLOCK)
    for block in range(0, V, BLOCK):
        mask = block + cols < V
        x = tl.load(logits_ptr + offset + block + cols, mask=mask, other=0.0).to(tl.float32) * inv_temperature
        d = (tl.where(block + cols == token, 1.0, 0.0) - tl.exp(x - lse)) * g
        tl.store(grad_ptr + offset + block + cols, d.to(grad_ptr.dtype.element_ty), mask=mask)


class LogProbs(torch.autograd.Function):
    """log softmax(logits / T)[token_ids], (..., V), (...) -> (...) fp32, by the kernels above."""

    @staticmethod
    def forward(ctx, logits, token_ids, temperature, block):
        V = logits.size(-1)
        rows, ids = logits.reshape(-1, V).contiguous(), token_ids.reshape(-1).contiguous()
        logps = torch.empty(rows.size(0), device=logits.device, dtype=torch.float32)
        lse = torch.empty_like(logps)
        _logp_forward[(rows.size(0),)](rows, ids, logps, lse, V, 1.0 / temperature, BLOCK=block, **NO_FMA)
        ctx.save_for_backward(rows, ids, lse)
        ctx.temperature, ctx.block, ctx.shape = temperature, block, logits.shape
        # write the gradient over the logits when they are an intermediate nothing else reads
        ctx.overwrite = logits.grad_fn is not None and logits._base is None and logits.is_contiguous()
        return logps.view(token_ids.shape)

    @staticmethod
    def backward(ctx, grad_logps):
        rows, ids, lse = ctx.saved_tensors
        grad = rows if ctx.overwrite else torch.empty_like(rows)
        _logp_backward[(rows.size(0),)](rows, grad, ids, lse, grad_logps.reshape(-1).float().contiguous(),
                                        rows.size(1), 1.0 / ctx.temperature, BLOCK=ctx.block, **NO_FMA)
        return grad.view(ctx.shape), None, None, None


@triton.jit
def _grpo_per_token(logps_ptr, old_ptr, ref_ptr, adv_ptr, loss_ptr, ratio_ptr, kl_ptr, dlogps_ptr,
                    N, C, beta, low, high, HAS_KL: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < N
    logp = tl.load(logps_ptr + i, mask=mask, other=0.0)
    ratio = tl.exp(logp - tl.load(old_ptr + i, mask=mask, other=0.0))
    A = tl.load(adv_ptr + i // C, mask=mask, other=0.0)  # one advantage per sequence
    unclipped, clipped = ratio * A, tl.minimum(tl.maximum(ratio, low), high) * A
    loss = -tl.minimum(unclipped, clipped)
    # d loss / d logp: -A * ratio through whichever term is the min; through the clipped term only
    # inside the clip range; half through each on a tie (as torch.min's gradient)
    inside = ((ratio >= low) & (ratio <= high)).to(tl.float32)
    weight = tl.where(unclipped < clipped, 1.0, tl.where(unclipped > clipped, inside, 0.5 * (1.0 + inside)))
    dlogp = -A * ratio * weight
    kl = tl.zeros_like(loss)
    if HAS_KL:  # k3: exp(ref - logp) - (ref - logp) - 1, derivative 1 - exp(ref - logp)
        delta = tl.load(ref_ptr + i, mask=mask, other=0.0) - logp
        kl = tl.exp(delta) - delta - 1.0
        loss += beta * kl
        dlogp += beta * (1.0 - tl.exp(delta))
    tl.store(loss_ptr + i, loss, mask=mask)
    tl.store(ratio_ptr + i, ratio, mask=mask)
    tl.store(kl_ptr + i, kl, mask=mask)
    tl.store(dlogps_ptr + i, dlogp, mask=mask)


class PerTokenLoss(torch.autograd.Function):
    """(per-token loss, ratio, kl), (B, C) each, as grpo_math.per_token_loss; gradient to logps only."""

    @staticmethod
    def forward(ctx, logps, old_logps, ref_logps, advantages, beta, epsilon, epsilon_high, block):
        logps, old_logps = logps.float().contiguous(), old_logps.float().contiguous()
        has_kl = beta != 0.0
        ref = ref_logps.float().contiguous() if has_kl else logps
        loss, ratio, kl, dlogps = (torch.empty_like(logps) for _ in range(4))
        N, C = logps.numel(), logps.size(1)
        _grpo_per_token[(triton.cdiv(N, block),)](logps, old_logps, ref, advantages.float().contiguous(), loss, ratio,
                                                  kl, dlogps, N, C, float(beta), 1.0 - epsilon, 1.0 + epsilon_high,
                                                  HAS_KL=has_kl, BLOCK=block)
        ctx.save_for_backward(dlogps)
        ctx.mark_non_differentiable(ratio, kl)
        return loss, ratio, kl

    @staticmethod
    def backward(ctx, grad_loss, grad_ratio, grad_kl):
        (dlogps,) = ctx.saved_tensors
        return grad_loss * dlogps, None, None, None, None, None, None, None
