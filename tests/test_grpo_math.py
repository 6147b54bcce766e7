"""grpo_math.py: the loss, advantages, masks and log-probs against hand computations."""
import math

import pytest
import torch

from grpo_math import completion_mask, group_advantages, grpo_loss


from simple_grpo.logprobs import selective_log_softmax, sequence_logps


def test_loss_equals_a_hand_computed_value():
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -9.0]])
    old = torch.tensor([[-1.1, -1.5, -0.5], [-0.3, -1.0, -9.0]])
    ref = torch.tensor([[-1.0, -2.5, -0.4], [-0.5, -1.2, -9.0]])
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    beta, eps = 0.1, 0.2

    def token_loss(lp, o, r, a):
        ratio = math.exp(lp - o)
        clipped = min(max(ratio, 1 - eps), 1 + eps)
        d = r - lp
        return -min(ratio * a, clipped * a) + beta * (math.exp(d) - d - 1)

    seq0 = sum(token_loss(*v, 1.0) for v in zip(logps[0].tolist(), old[0].tolist(), ref[0].tolist())) / 3
    seq1 = sum(token_loss(*v, -2.0) for v in zip(logps[1, :2].tolist(), old[1, :2].tolist(), ref[1, :2].tolist())) / 2
    loss, stats = grpo_loss(logps, old, ref, adv, mask, beta=beta, epsilon=eps, epsilon_high=eps)
    assert loss.item() == pytest.approx((seq0 + seq1) / 2, abs=1e-6)
    # token (0, 1): ratio e^-0.5 < 0.8 with A > 0 is not clipped; token (1, 1): ratio e^-0.2 = 0.82 not clipped;
    # token (0, 0): ratio e^0.1 = 1.105 inside the range: no token is clipped here
    assert stats["clip_fraction"] == 0.0


def test_clip_fraction_counts_tokens_where_the_clip_is_active():
    logps = torch.tensor([[0.0, 0.0]])
    old = torch.tensor([[-0.5, 0.5]])  # ratios e^0.5 = 1.65 (above) and e^-0.5 = 0.61 (below)
    _, up = grpo_loss(logps, old, None, torch.tensor([1.0]), torch.ones(1, 2), beta=0.0, epsilon=0.2)
    _, down = grpo_loss(logps, old, None, torch.tensor([-1.0]), torch.ones(1, 2), beta=0.0, epsilon=0.2)
    assert up["clip_fraction"] == 0.5 and down["clip_fraction"] == 0.5


def test_policy_equal_to_reference_and_behaviour_gives_ratio_one_and_zero_kl():
    logps = torch.randn(4, 6).clamp(max=0)
    loss, stats = grpo_loss(logps, logps.clone(), logps.clone(), torch.randn(4), torch.ones(4, 6), beta=0.04)
    assert stats["ratio_mean"] == pytest.approx(1.0) and stats["kl"] == pytest.approx(0.0)


def test_gradient_at_ratio_one_with_beta_zero_is_that_of_minus_advantage_times_logp():
    torch.manual_seed(0)
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    adv = torch.tensor([0.5, -1.0, 2.0])
    x = torch.randn(3, 4, requires_grad=True)
    loss, _ = grpo_loss(x, x.detach(), None, adv, mask, beta=0.0)
    (grad,) = torch.autograd.grad(loss, x)
    y = x.detach().clone().requires_grad_(True)
    expected = ((-adv[:, None] * y * mask).sum(1) / mask.sum(1)).mean()
    (expected_grad,) = torch.autograd.grad(expected, y)
    assert torch.allclose(grad, expected_grad, atol=1e-7)


def test_groups_with_equal_rewards_contribute_no_gradient():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5])  # group 0 all equal
    adv = group_advantages(rewards, group_size=4)
    assert torch.all(adv[:4] == 0)
    x = torch.randn(8, 5, requires_grad=True)
    loss, _ = grpo_loss(x, x.detach(), None, adv, torch.ones(8, 5), beta=0.0)
    loss.backward()
    assert torch.all(x.grad[:4] == 0) and x.grad[4:].abs().sum() > 0


def test_group_advantages_are_normalised_within_each_group():
    rewards = torch.tensor([0.0, 1.0, 1.0, 2.0, 5.0, 5.0, 5.0, 9.0])
    adv = group_advantages(rewards, group_size=4, eps=0.0).view(2, 4)
    r = rewards.view(2, 4)
    assert torch.allclose(adv, (r - r.mean(1, keepdim=True)) / r.std(1, keepdim=True))
    assert torch.allclose(adv.mean(1), torch.zeros(2), atol=1e-6)


def test_eos_is_inside_the_mask_and_what_follows_is_not():
    eos, pad = 2, 0
    ids = torch.tensor([[5, 6, eos, pad, pad], [5, eos, 7, eos, pad], [5, 6, 7, 8, 9]])
    assert completion_mask(ids, eos).tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]


def test_eos_is_trained_even_when_pad_equals_eos():
    eos = pad = 2
    ids = torch.tensor([[5, 6, eos, pad, pad]])
    assert completion_mask(ids, eos).tolist() == [[1, 1, 1, 0, 0]]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logps_equal_naive_log_softmax_gather(temperature):
    torch.manual_seed(0)
    logits = torch.randn(5, 7, 301) * 4
    ids = torch.randint(0, 301, (5, 7))
    naive = (logits / temperature).log_softmax(-1).gather(-1, ids[..., None])[..., 0]
    chunked = selective_log_softmax(logits, ids, temperature, chunk_rows=2)
    assert torch.allclose(chunked, naive, atol=1e-6)


@pytest.mark.parametrize("overwrite", [False, True])
def test_chunked_logps_gradient_equals_autograd_of_naive(overwrite):
    """The hand-written backward, allocating a gradient (leaf logits) or writing it over the
    logits (an intermediate, as the lm_head output is)."""
    torch.manual_seed(0)
    leaf = (torch.randn(3, 6, 301) * 4).requires_grad_()
    ids, weights = torch.randint(0, 301, (3, 6)), torch.randn(3, 6)
    naive = (leaf / 0.7).log_softmax(-1).gather(-1, ids[..., None])[..., 0]
    expected, = torch.autograd.grad((naive * weights).sum(), leaf)
    logits = leaf * 1.0 if overwrite else leaf
    got, = torch.autograd.grad((selective_log_softmax(logits, ids, 0.7, chunk_rows=4) * weights).sum(), leaf)
    assert torch.allclose(got, expected, atol=1e-6)


def test_unknown_loss_type_is_an_error():
    with pytest.raises(ValueError, match="loss_type"):
        grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), None, torch.zeros(1), torch.ones(1, 1), beta=0.0,
                  loss_type="nope")


def test_shared_prompt_logps_and_gradients_equal_one_forward_per_sequence():
    """sequence_logps runs each prompt once and copies its KV cache to the G completions:
    values and gradients must equal a plain forward over each left-padded prompt + completion."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained("models/tiny-math", dtype=torch.float32)
    Q, G, P, C = 2, 3, 9, 5
    prompt_ids = torch.randint(10, 500, (Q, P))
    prompt_mask = torch.ones(Q, P, dtype=torch.long)
    prompt_mask[1, :4] = 0  # the second prompt is shorter: left padding
    completion_ids = torch.randint(10, 500, (Q * G, C))

    shared = sequence_logps(model, prompt_ids, prompt_mask, completion_ids, temperature=0.7)
    shared_grad = torch.autograd.grad(shared.sum(), model.model.embed_tokens.weight)[0]

    naive = []
    for i in range(Q * G):
        real = prompt_ids[i // G][prompt_mask[i // G].bool()]
        ids = torch.cat([real, completion_ids[i]])[None]
        logits = model(ids).logits[:, real.numel() - 1:-1] / 0.7
        naive.append(logits.log_softmax(-1).gather(-1, completion_ids[i][None, :, None])[..., 0])
    naive = torch.cat(naive)
    naive_grad = torch.autograd.grad(naive.sum(), model.model.embed_tokens.weight)[0]
    assert shared.shape == (Q * G, C)
    assert torch.allclose(shared, naive, atol=1e-5)
    assert torch.allclose(shared_grad, naive_grad, atol=1e-4)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_lessons_log_probs_equal_the_full_trainers(checkpointing):
    """grpo_math.completion_logps (the lessons' and ref_server.py's: each prompt once on a copied KV cache, one
    log_softmax; under gradient checkpointing in training, one plain forward over prompt + completion) and
    simple_grpo.logprobs.sequence_logps (the full trainer's: the log-softmax chunked) give the same log-probs,
    gradients and entropies, left padding included."""
    from transformers import AutoModelForCausalLM
    from grpo_math import completion_logps
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained("models/tiny-math", dtype=torch.float32).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    prompt_ids, completion_ids = torch.randint(10, 500, (2, 9)), torch.randint(10, 500, (6, 5))
    prompt_mask = torch.ones(2, 9, dtype=torch.long)
    prompt_mask[1, :4] = 0  # the second prompt is shorter: left padding
    fast, fast_entropy = sequence_logps(model, prompt_ids, prompt_mask, completion_ids, 0.7, entropy=True)
    fast_grad = torch.autograd.grad(fast.sum(), model.model.embed_tokens.weight)[0]
    plain, plain_entropy = completion_logps(model, prompt_ids, prompt_mask, completion_ids, 0.7)
    plain_grad = torch.autograd.grad(plain.sum(), model.model.embed_tokens.weight)[0]
    assert plain.shape == plain_entropy.shape == (6, 5)
    assert torch.allclose(plain, fast, atol=1e-5)
    assert torch.allclose(plain_grad, fast_grad, atol=1e-4)
    assert torch.allclose(plain_entropy, fast_entropy, atol=1e-4)  # near 0 the two formulas round apart
    one, _ = completion_logps(model, prompt_ids, prompt_mask, completion_ids[:, :1], 0.7)  # one token: no 2nd pass
    assert torch.allclose(one, fast[:, :1], atol=1e-5)


def test_completions_must_split_evenly_over_prompts():
    with pytest.raises(ValueError, match="per prompt"):
        sequence_logps(None, torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long),
                       torch.zeros(5, 4, dtype=torch.long))


def test_entropy_from_the_log_prob_pass_equals_a_plain_forwards():
    """sequence_logps(entropy=True) takes the entropy from the logits it computes the log-probs from (no
    extra forward); it equals -sum p log p of softmax(logits / T) from one plain forward over prompt +
    completion, to 1e-5 in fp32."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("models/tiny-math", dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, 500, (2, 6), generator=g)
    prompt_ids[1, :2] = 0  # left padding
    prompt_mask = (prompt_ids != 0).long()
    completion_ids = torch.randint(3, 500, (6, 5), generator=g)  # G = 3 completions per prompt
    T = 0.7
    with torch.no_grad():
        logps, entropy = sequence_logps(model, prompt_ids, prompt_mask, completion_ids, T, entropy=True)
        ids = torch.cat([prompt_ids.repeat_interleave(3, 0), completion_ids], 1)
        mask = torch.cat([prompt_mask.repeat_interleave(3, 0), torch.ones_like(completion_ids)], 1)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
        p = torch.softmax(logits[:, 5:-1] / T, dim=-1)  # positions predicting the 5 completion tokens
        expected = -(p * torch.log(p)).sum(-1)
    assert entropy.shape == logps.shape == (6, 5)
    assert torch.allclose(entropy, expected, atol=1e-5, rtol=0)
    assert entropy.min() > 0


def test_clip_fractions_below_and_above_and_ratio_extremes():
    logps = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    old = torch.tensor([[0.5, -0.5, 0.0, -0.5]])  # ratios e^-0.5 = 0.61, e^0.5 = 1.65, 1, 1.65
    for adv, low, high in ((torch.tensor([-1.0]), 0.25, 0.0), (torch.tensor([1.0]), 0.0, 0.5)):
        _, stats = grpo_loss(logps, old, None, adv, torch.ones(1, 4), beta=0.0, epsilon=0.2)
        assert stats["clip_low_frac"] == pytest.approx(low) and stats["clip_high_frac"] == pytest.approx(high)
        assert stats["clip_fraction"] == pytest.approx(low + high)
        assert stats["ratio_min"] == pytest.approx(math.exp(-0.5)) and stats["ratio_max"] == pytest.approx(math.exp(0.5))


def test_the_one_screen_objective_equals_grpo_loss_on_random_inputs():
    """grpo_objective (the loss as read, term by term) and grpo_loss (the trainers', every option) give the
    same number and the same gradient at the default options, on random groups with padding."""
    from grpo_math import grpo_objective
    g = torch.Generator().manual_seed(0)
    Q, G, C = 3, 4, 7
    logps = (-torch.rand(Q * G, C, generator=g) * 3).requires_grad_()
    old = logps.detach() + 0.3 * torch.randn(Q * G, C, generator=g)
    ref = logps.detach() + 0.2 * torch.randn(Q * G, C, generator=g)
    rewards = torch.randint(0, 3, (Q * G,), generator=g).float()
    mask = (torch.arange(C)[None] < torch.randint(2, C + 1, (Q * G, 1), generator=g)).float()
    mine = grpo_objective(logps, old, ref, rewards, mask, G, beta=0.04, epsilon=0.2)
    (grad_mine,) = torch.autograd.grad(mine, logps)
    theirs, _ = grpo_loss(logps, old, ref, group_advantages(rewards, G), mask, beta=0.04, epsilon=0.2)
    (grad_theirs,) = torch.autograd.grad(theirs, logps)
    assert mine.item() == pytest.approx(theirs.item(), abs=1e-6)
    assert torch.allclose(grad_mine, grad_theirs, atol=1e-7)
    # the demo's trainer (simple_grpo/train.py): vLLM's log-probs weight each token, capped at tis_cap
    sampler = old + 0.5 * torch.randn(Q * G, C, generator=g)
    mine = grpo_objective(logps, old, ref, rewards, mask, G, sampler_logps=sampler, tis_cap=2.0)
    (grad_mine,) = torch.autograd.grad(mine, logps)
    theirs, stats = grpo_loss(logps, old, ref, group_advantages(rewards, G), mask, sampler_logps=sampler, tis_cap=2.0)
    (grad_theirs,) = torch.autograd.grad(theirs, logps)
    assert stats["is_capped_frac"] > 0  # the cap acted on some tokens
    assert mine.item() == pytest.approx(theirs.item(), abs=1e-6)
    assert torch.allclose(grad_mine, grad_theirs, atol=1e-7)
