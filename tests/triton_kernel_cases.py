"""triton_loss/ kernels in Triton's CPU interpreter against torch autograd: forward and gradient.

Run by tests/test_triton_loss.py in a process of its own with TRITON_INTERPRET=1 set before anything
imports triton: Triton picks compiled or interpreted kernels (its own tl.max included) at import.
On a GPU, `pytest tests/triton_kernel_cases.py` runs the same cases compiled, on CUDA tensors."""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    pass  # the interpreter: tensors on the CPU
elif torch.cuda.is_available():
    torch.set_default_device("cuda")  # compiled kernels on a GPU: `pytest tests/triton_kernel_cases.py` there
else:
    raise pytest.UsageError("run with TRITON_INTERPRET=1 (tests/test_triton_loss.py does) or on a GPU")

from grpo_math import grpo_loss, per_token_loss  # noqa: E402
from simple_grpo.logprobs import sequence_logps  # noqa: E402
from triton_loss import per_token_loss_triton, selective_log_softmax_triton  # noqa: E402


def naive_logps(logits, ids, temperature):
    return (logits.float() / temperature).log_softmax(-1).gather(-1, ids[..., None])[..., 0]


@pytest.mark.parametrize("V, scale, temperature", [(1000, 3.0, 1.0), (4099, 3.0, 0.7), (3001, 1e4, 0.6),
                                                   (2048, 1e4, 1.3)])
def test_logprob_kernel_matches_autograd_forward_and_gradient(V, scale, temperature):
    """V not a power of two and over several blocks, logits of magnitude 1e4, temperature != 1,
    masked positions (their upstream gradient is 0), fp32."""
    torch.manual_seed(V)
    leaf = (torch.randn(2, 7, V) * scale).requires_grad_()
    ids = torch.randint(0, V, (2, 7))
    ids[0, 0] = leaf[0, 0].argmax()  # a dominant token too: its log-prob is ~0
    upstream = torch.randn(2, 7) * (torch.rand(2, 7) > 0.3)  # masked positions get no gradient
    expected = naive_logps(leaf, ids, temperature)
    expected_grad, = torch.autograd.grad((expected * upstream).sum(), leaf)
    for logits in (leaf, leaf * 1.0):  # a leaf (gradient allocated) and an intermediate (written over it)
        got = selective_log_softmax_triton(logits, ids, temperature)
        got_grad, = torch.autograd.grad((got * upstream).sum(), leaf)
        # fp32 carries ~7 significant digits: at 1e4 that is 1e-3 absolute, so relative there
        assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), (got - expected).abs().max()
        assert torch.allclose(got_grad, expected_grad, atol=1e-5), (got_grad - expected_grad).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_logprob_kernel_takes_half_precision_logits_and_accumulates_in_fp32(dtype):
    torch.manual_seed(0)
    leaf = (torch.randn(3, 5, 1500) * 4).to(dtype).requires_grad_()
    ids = torch.randint(0, 1500, (3, 5))
    upstream = torch.randn(3, 5)
    expected = naive_logps(leaf, ids, 0.7)  # the same half-precision values, upcast
    expected_grad, = torch.autograd.grad((expected * upstream).sum(), leaf)
    got = selective_log_softmax_triton(leaf, ids, 0.7)
    got_grad, = torch.autograd.grad((got * upstream).sum(), leaf)
    assert got.dtype == torch.float32 and torch.allclose(got, expected, atol=1e-5)
    assert got_grad.dtype == dtype  # the gradient, stored like the logits, differs by its rounding only
    assert torch.allclose(got_grad.float(), expected_grad.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("beta, epsilon, epsilon_high", [(0.04, 0.2, 0.2), (0.0, 0.2, 0.2), (0.1, 0.2, 0.28),
                                                         (0.04, 0.1, 0.3)])
def test_loss_kernel_matches_the_torch_loss_and_gradient(beta, epsilon, epsilon_high):
    """All loss options: with and without KL, symmetric and asymmetric clipping; ratios inside and
    outside the clip range, advantages of both signs and zero, masked positions, ratio exactly 1."""
    torch.manual_seed(1)
    B, C = 6, 9
    logps = (-torch.rand(B, C) * 3).requires_grad_()
    old_logps = logps.detach() + torch.randn(B, C) * 0.3
    old_logps[0] = logps.detach()[0]  # on-policy row: ratio 1
    ref_logps = -torch.rand(B, C) * 3
    advantages = torch.tensor([1.2, -0.7, 0.0, 2.0, -1.5, 0.4])
    mask = (torch.rand(B, C) > 0.25).float()
    args = (old_logps, ref_logps if beta else None, advantages, mask)
    options = {"beta": beta, "epsilon": epsilon, "epsilon_high": epsilon_high}
    loss_t, stats_t = grpo_loss(logps, *args, **options, impl="torch")
    grad_t, = torch.autograd.grad(loss_t, logps)
    loss_k, stats_k = grpo_loss(logps, *args, **options, impl="triton")
    grad_k, = torch.autograd.grad(loss_k, logps)
    assert abs(loss_k.item() - loss_t.item()) <= 1e-6
    assert torch.allclose(grad_k, grad_t, atol=1e-6)
    assert stats_k == pytest.approx(stats_t, abs=1e-6)
    assert stats_t["clip_fraction"] > 0  # the clip was exercised
    # per token too
    for got, want in zip(per_token_loss_triton(logps, old_logps, ref_logps, advantages, beta, epsilon, epsilon_high),
                         per_token_loss(logps, old_logps, ref_logps, advantages, beta, epsilon, epsilon_high)):
        assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("value", [-1e4, float("-inf"), float("nan")])
def test_the_loss_kernel_keeps_a_masked_position_out_of_the_loss_and_gradient(value):
    """A padded position's log-prob far below -88.7, -inf or NaN, its reference log-prob padded with 0: the
    kernel's loss and gradient are finite and equal those of the same batch with harmless numbers there."""
    torch.manual_seed(2)
    B, C = 4, 6
    clean = -torch.rand(B, C) * 3
    old_logps, ref_logps = clean + torch.randn(B, C) * 0.3, -torch.rand(B, C) * 3
    advantages, mask = torch.tensor([1.0, -0.5, 0.7, -1.2]), (torch.rand(B, C) > 0.3).float()
    off = mask == 0
    results = []
    for fill in (None, value):
        logps = (clean if fill is None else clean.masked_fill(off, fill)).clone().requires_grad_()
        old = old_logps if fill is None else old_logps.masked_fill(off, fill)
        ref = ref_logps if fill is None else ref_logps.masked_fill(off, 0.0)
        loss, _ = grpo_loss(logps, old, ref, advantages, mask, beta=0.04, impl="triton")
        grad, = torch.autograd.grad(loss, logps)
        results.append((loss, grad))
    (clean_loss, clean_grad), (loss, grad) = results
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert abs(loss.item() - clean_loss.item()) <= 1e-6 and torch.allclose(grad, clean_grad, atol=1e-7)
    assert (grad[off] == 0).all()


def test_sequence_logps_on_the_tiny_model_are_the_same_with_the_kernels():
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(os.path.join(os.path.dirname(os.path.dirname(__file__)),
                                                              "models", "tiny-math"), dtype=torch.float32).to(torch.get_default_device())
    torch.manual_seed(0)
    prompt_ids, completion_ids = torch.randint(3, 500, (2, 9)), torch.randint(3, 500, (6, 5))
    prompt_mask = torch.ones_like(prompt_ids)
    values, grads = [], []
    for impl in ("torch", "triton"):
        model.zero_grad()
        logps = sequence_logps(model, prompt_ids, prompt_mask, completion_ids, 0.7, impl=impl)
        logps.sum().backward()
        values.append(logps.detach())
        grads.append(model.lm_head.weight.grad.clone())
    assert torch.allclose(values[0], values[1], atol=1e-5)
    assert torch.allclose(grads[0], grads[1], atol=1e-5)
