"""triton_loss: fused Triton kernels for the log-prob and loss path, --loss_impl triton (README.md here), with
the numbers of the torch versions; check_loss_impl refuses it where Triton cannot run."""
import os

import torch

LOGP_BLOCK = 1024  # vocabulary entries a program reads at a time
LOSS_BLOCK = 1024  # tokens a program handles in the loss kernel


def triton_problem():
    """Why the kernels cannot run here, or None when they can."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        return None
    return "no GPU for Triton (TRITON_INTERPRET=1 runs the kernels on CPU, slowly)"


def check_loss_impl(loss_impl):
    """Stop on a --loss_impl that is not 'torch' or 'triton', or on 'triton' where Triton cannot run."""
    if loss_impl not in ("torch", "triton"):
        raise SystemExit(f"--loss_impl must be 'torch' or 'triton', got {loss_impl!r}")
    if loss_impl == "triton" and (problem := triton_problem()):
        raise SystemExit(f"--loss_impl triton: {problem}; use --loss_impl torch (the same numbers)")


def selective_log_softmax_triton(logits, token_ids, temperature=1.0):
    """log softmax(logits / temperature)[token_ids], (B, T, V), (B, T) -> (B, T), fused."""
    from triton_loss.kernels import LogProbs
    return LogProbs.apply(logits, token_ids, temperature, LOGP_BLOCK)


def per_token_loss_triton(logps, old_logps, ref_logps, advantages, beta, epsilon, epsilon_high):
    """grpo_math.per_token_loss in one kernel: (per-token loss, ratio, kl), (B, C) each."""
    from triton_loss.kernels import PerTokenLoss
    return PerTokenLoss.apply(logps, old_logps, ref_logps, advantages, beta, epsilon, epsilon_high, LOSS_BLOCK)
