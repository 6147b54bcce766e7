"""Every loss option of grpo_math against a hand computation on one small batch.

Two sequences of three tokens; the second has two real tokens (its third is masked). The hand
versions below are plain Python on floats, written from the formulas in the papers."""
import math

import pytest
import torch

from grpo_math import completion_mask, group_advantages, groups_with_signal, grpo_loss, kl_estimate
from simple_grpo.rollouts import correct_rows

LOGPS = [[-1.0, -2.0, -0.5], [-0.3, -1.2, -9.0]]
OLD = [[-1.1, -1.5, -0.5], [-0.3, -1.0, -9.0]]
REF = [[-1.0, -2.5, -0.4], [-0.5, -1.2, -9.0]]
ADV = [1.0, -2.0]
MASK = [[1, 1, 1], [1, 1, 0]]
TOKENS = [(i, t) for i in range(2) for t in range(3) if MASK[i][t]]  # the 5 real tokens


def tensors():
    logps = torch.tensor(LOGPS, requires_grad=True)
    return logps, torch.tensor(OLD), torch.tensor(REF), torch.tensor(ADV), torch.tensor(MASK, dtype=torch.float)


def hand_kl(lp, ref, estimator):
    d = ref - lp
    return {"k1": -d, "k2": d * d / 2, "k3": math.exp(d) - d - 1}[estimator]


def hand_clipped(ratio, a, eps_low, eps_high):
    return -min(ratio * a, min(max(ratio, 1 - eps_low), 1 + eps_high) * a)


def hand_token_losses(eps_low=0.2, eps_high=0.2, beta=0.0, estimator="k3"):
    """{(i, t): loss} for the clipped surrogate with a per-token ratio."""
    return {(i, t): hand_clipped(math.exp(LOGPS[i][t] - OLD[i][t]), ADV[i], eps_low, eps_high)
            + beta * hand_kl(LOGPS[i][t], REF[i][t], estimator) for i, t in TOKENS}


def per_sequence_mean(losses):
    return sum(sum(v for (i, _), v in losses.items() if i == s) / sum(MASK[s]) for s in range(2)) / 2


@pytest.mark.parametrize("beta, estimator", [(0.0, "k3"), (0.1, "k1"), (0.1, "k2"), (0.1, "k3")])
def test_grpo_is_the_mean_over_sequences_of_each_sequences_token_mean(beta, estimator):
    logps, old, ref, adv, mask = tensors()
    loss, stats = grpo_loss(logps, old, ref, adv, mask, beta=beta, epsilon=0.2, kl_estimator=estimator)
    assert loss.item() == pytest.approx(per_sequence_mean(hand_token_losses(beta=beta, estimator=estimator)), abs=1e-6)
    kl = sum(hand_kl(LOGPS[i][t], REF[i][t], estimator) for i, t in TOKENS) / 5
    assert stats["kl"] == pytest.approx(kl if beta else 0.0, abs=1e-6)


def test_bnpo_is_the_mean_over_all_tokens():
    logps, old, ref, adv, mask = tensors()
    loss, _ = grpo_loss(logps, old, ref, adv, mask, beta=0.1, loss_type="bnpo")
    assert loss.item() == pytest.approx(sum(hand_token_losses(beta=0.1).values()) / 5, abs=1e-6)


def test_dr_grpo_divides_the_token_sum_by_batch_size_times_max_completion_length():
    logps, old, ref, adv, mask = tensors()
    loss, _ = grpo_loss(logps, old, ref, adv, mask, beta=0.1, loss_type="dr_grpo", max_completion_length=8)
    assert loss.item() == pytest.approx(sum(hand_token_losses(beta=0.1).values()) / (2 * 8), abs=1e-6)
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_loss(logps, old, ref, adv, mask, loss_type="dr_grpo")


def test_dapo_is_the_token_mean_with_a_higher_upper_clip():
    """Token (1, 1) has ratio e^-0.2 = 0.82 and A < 0: clipped at 1 - 0.1 = 0.9 for the low side;
    token (0, 0) has ratio e^0.1 = 1.105 and A > 0: clipped at 1.05 with epsilon_high 0.05, not at 1.28."""
    logps, old, ref, adv, mask = tensors()
    for eps_high in (0.05, 0.28):
        loss, _ = grpo_loss(logps, old, ref, adv, mask, beta=0.0, epsilon=0.1, epsilon_high=eps_high, loss_type="dapo")
        want = sum(hand_token_losses(eps_low=0.1, eps_high=eps_high).values()) / 5
        assert loss.item() == pytest.approx(want, abs=1e-6)
    assert hand_token_losses(eps_low=0.1, eps_high=0.05)[0, 0] != hand_token_losses(eps_low=0.1, eps_high=0.28)[0, 0]


def test_cispo_weights_logp_by_the_capped_detached_ratio():
    """loss = -sum sg(min(r, 1 + eps_high)) * A * logp / tokens; its gradient is -min(r, 1 + eps_high) * A / tokens."""
    logps, old, ref, adv, mask = tensors()
    loss, stats = grpo_loss(logps, old, ref, adv, mask, beta=0.0, epsilon_high=0.05, loss_type="cispo")
    weight = {(i, t): min(math.exp(LOGPS[i][t] - OLD[i][t]), 1.05) for i, t in TOKENS}
    assert loss.item() == pytest.approx(sum(-weight[k] * ADV[k[0]] * LOGPS[k[0]][k[1]] for k in TOKENS) / 5, abs=1e-6)
    grad, = torch.autograd.grad(loss, logps)
    for i in range(2):
        for t in range(3):
            want = -weight[i, t] * ADV[i] / 5 if MASK[i][t] else 0.0
            assert grad[i, t].item() == pytest.approx(want, abs=1e-6)
    assert stats["clip_fraction"] == pytest.approx(1 / 5)  # only token (0, 0), ratio 1.105 > 1.05, is capped


def test_sequence_level_importance_ratio_is_gspo():
    """ratio_i = exp(mean over the sequence's real tokens of (logp - old)), shared by its tokens;
    with the ratios inside the clip range, d loss / d logp_it = -(1/2) * A_i * ratio_i / n_i."""
    logps, old, ref, adv, mask = tensors()
    loss, stats = grpo_loss(logps, old, ref, adv, mask, beta=0.0, epsilon=0.2, importance_sampling_level="sequence")
    n = [3, 2]
    ratio = [math.exp(sum(LOGPS[i][t] - OLD[i][t] for t in range(n[i])) / n[i]) for i in range(2)]
    assert ratio == pytest.approx([math.exp(-0.4 / 3), math.exp(-0.1)])
    assert loss.item() == pytest.approx(sum(hand_clipped(ratio[i], ADV[i], 0.2, 0.2) for i in range(2)) / 2, abs=1e-6)
    grad, = torch.autograd.grad(loss, logps)
    for i, t in TOKENS:
        assert grad[i, t].item() == pytest.approx(-0.5 * ADV[i] * ratio[i] / n[i], abs=1e-6)
    assert grad[1, 2].item() == 0.0
    assert stats["ratio_mean"] == pytest.approx((3 * ratio[0] + 2 * ratio[1]) / 5, abs=1e-6)


def test_kl_estimators():
    lp, ref = torch.tensor([-1.0, -0.2]), torch.tensor([-1.5, -0.2])
    assert kl_estimate(lp, ref, "k1").tolist() == pytest.approx([0.5, 0.0])
    assert kl_estimate(lp, ref, "k2").tolist() == pytest.approx([0.125, 0.0])
    assert kl_estimate(lp, ref, "k3").tolist() == pytest.approx([math.exp(-0.5) + 0.5 - 1, 0.0])
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(lp, ref, "k4")


def test_scale_rewards_group_batch_and_none():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])  # two groups of 4
    centred = [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]
    group_std = [math.sqrt(1 / 3), math.sqrt(0.75 / 3)]  # unbiased: sum of squares / (4 - 1)
    mean = 5 / 8
    batch_std = math.sqrt(sum((r - mean) ** 2 for r in rewards.tolist()) / 7)
    got = {s: group_advantages(rewards, 4, scale_rewards=s).tolist() for s in ("group", "batch", "none")}
    assert got["group"] == pytest.approx([c / (group_std[k // 4] + 1e-4) for k, c in enumerate(centred)], abs=1e-6)
    assert got["batch"] == pytest.approx([c / (batch_std + 1e-4) for c in centred], abs=1e-6)
    assert got["none"] == pytest.approx(centred, abs=1e-6)
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(rewards, 4, scale_rewards="sequence")


def test_mask_truncated_completions_drops_a_completion_cut_off_without_eos():
    eos = 2
    ids = torch.tensor([[5, 2, 2], [5, 6, 7]])  # the second never ended
    assert completion_mask(ids, eos).tolist() == [[1, 1, 0], [1, 1, 1]]
    assert completion_mask(ids, eos, mask_truncated=True).tolist() == [[1, 1, 0], [0, 0, 0]]


def test_unknown_options_name_the_option():
    logps, old, ref, adv, mask = tensors()
    for kwargs, name in (({"loss_type": "ppo"}, "loss_type"), ({"importance_sampling_level": "word"},
                                                                  "importance_sampling_level")):
        with pytest.raises(ValueError, match=name):
            grpo_loss(logps, old, ref, adv, mask, **kwargs)


def test_raft_keeps_the_correct_completions_and_none_of_a_group_with_none():
    """Rewards as the recipe sums them: correctness 1.0 + format 0.5. The last group is all wrong and all well
    formatted: its rewards are equal and above 0, and RAFT keeps none of it (the best-rewarded of it are wrong)."""
    rewards = torch.tensor([1.5, 0.5, 1.5, 0.0,   0.0, 0.0, 0.0, 0.0,   1.5, 1.5, 1.5, 1.5,   0.5, 0.5, 0.5, 0.5])
    scores = [{"reward": r, "correctness": float(r >= 1.0), "format": float(r in (0.5, 1.5))} for r in rewards.tolist()]
    correct = correct_rows(scores, {"correctness": 1.0, "format": 0.5})
    A = group_advantages(rewards, 4, estimator="raft", correct=correct)
    assert A.tolist() == [1, 0, 1, 0,   0, 0, 0, 0,   1, 1, 1, 1,   0, 0, 0, 0]
    # the all-right group has signal for RAFT (supervised on it), none for GRPO (every advantage 0)
    assert groups_with_signal(A, 4).tolist() == [True, False, True, False]
    assert groups_with_signal(group_advantages(rewards, 4), 4).tolist() == [True, False, False, False]
    # the accuracy reward the trainers log decides, not the first reward listed
    assert correct_rows([{"reward": 1.0, "answer_is": 1.0, "correctness": 0.0}], {"answer_is": 1.0}).tolist() == [1.0]
    with pytest.raises(ValueError, match="pass correct"):
        group_advantages(rewards, 4, estimator="raft")
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        group_advantages(rewards, 4, estimator="ppo")


def test_groups_with_signal_are_the_groups_whose_rewards_differ_under_grpo():
    g = torch.Generator().manual_seed(0)
    for scale in ("group", "batch", "none"):
        rewards = torch.randint(0, 4, (64 * 8,), generator=g).float() * 0.5
        rewards[:8 * 8] = 1.0  # some all-alike groups
        A = group_advantages(rewards, 8, scale_rewards=scale)
        assert torch.equal(groups_with_signal(A, 8), rewards.view(-1, 8).std(1) > 0)


def test_the_raft_loss_is_supervised_training_on_the_kept_completions():
    """At ratio 1 (the first iteration) with beta 0, grpo_loss with RAFT's advantages has the gradient of
    the mean over completions of -(mean token log-prob) of the kept ones: rejection-sampling fine-tuning."""
    g = torch.Generator().manual_seed(1)
    logps = (-torch.rand(8, 5, generator=g) * 3).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 1, 1]] * 4 + [[1, 1, 0, 0, 0]] * 4, dtype=torch.float)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    A = group_advantages(rewards, 4, estimator="raft", correct=rewards)
    loss, _ = grpo_loss(logps, logps.detach(), None, A, mask, beta=0.0)
    loss.backward()
    kept = A.bool()
    logps2 = logps.detach().clone().requires_grad_()
    sft = -((logps2 * mask).sum(1) / mask.sum(1))[kept].sum() / 8  # the kept ones' NLL over all 8 completions
    sft.backward()
    assert torch.allclose(logps.grad, logps2.grad, atol=1e-7)


# ---------------------------------------------------------------------------- masked positions
POISONS = [-1e4, float("-inf"), float("nan")]  # what a padded position can hold: far below -88.7 (k3's exp
# overflows in float32), -inf (a log-prob of 0 probability), NaN (anything at all)


def poisoned(value):
    """The small batch with every masked position of every input set to `value`; the kept ones unchanged."""
    logps, old, ref, adv, mask = tensors()
    off = mask == 0
    leaf = logps.detach().masked_fill(off, value).requires_grad_()
    return leaf, old.masked_fill(off, value), ref.masked_fill(off, 0.0 if value != value else value), adv, mask


@pytest.mark.parametrize("value", POISONS)
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_what_a_masked_position_holds_never_reaches_the_loss_or_the_gradient(value, loss_type, level, estimator):
    """The reference's log-probs are padded with 0 past a completion's end, and the policy's log-prob of a padding
    token can be -inf: k3's exp(ref - logp) is inf there, and inf x 0 (the mask) would be NaN. With the sampler's
    log-probs too (capped importance sampling), every loss option: the same loss and gradient as a clean batch,
    and no gradient at a masked position."""
    options = {"beta": 0.04, "epsilon": 0.2, "loss_type": loss_type, "importance_sampling_level": level,
               "kl_estimator": estimator, "max_completion_length": 3}
    clean_logps, old, ref, adv, mask = tensors()
    clean, clean_stats = grpo_loss(clean_logps, old, ref, adv, mask, sampler_logps=old - 0.1, **options)
    clean_grad, = torch.autograd.grad(clean, clean_logps)
    logps, old_p, ref_p, adv, mask = poisoned(value)
    loss, stats = grpo_loss(logps, old_p, ref_p, adv, mask, sampler_logps=old_p - 0.1, **options)
    grad, = torch.autograd.grad(loss, logps)
    assert torch.isfinite(loss) and torch.isfinite(grad).all(), (loss, grad)
    assert loss.item() == pytest.approx(clean.item(), abs=1e-6)
    assert torch.allclose(grad, clean_grad, atol=1e-7)
    assert (grad[mask == 0] == 0).all()
    assert all(math.isfinite(v) for v in stats.values()) and stats == pytest.approx(clean_stats, abs=1e-6)


@pytest.mark.parametrize("options", [{"loss_type": "grpo"}, {"loss_type": "bnpo"}, {"loss_type": "dapo"},
                                     {"loss_type": "cispo"}, {"loss_type": "dr_grpo", "max_completion_length": 6},
                                     {"loss_type": "grpo", "importance_sampling_level": "sequence"}],
                         ids=["grpo", "bnpo", "dapo", "cispo", "dr_grpo", "gspo"])
def test_parts_that_divide_by_the_whole_batchs_count_add_up_to_the_whole_batchs_loss(options):
    """grpo_math.loss_denominator's rule: a batch split 3 rows + 1 row (as over two ranks whose rewards left them
    3 groups and 1), each part divided by the whole batch's count, gives the whole batch's loss and gradient;
    each part divided by its own count and averaged (what the ranks did before) does not."""
    from grpo_math import loss_denominator
    g = torch.Generator().manual_seed(0)
    logps = (-torch.rand(4, 6, generator=g) * 3).requires_grad_()
    old, ref, adv = logps.detach() + 0.05 * torch.randn(4, 6, generator=g), logps.detach() - 0.1, torch.randn(4, generator=g)
    mask = torch.ones(4, 6)
    mask[:3, 3:] = 0  # the 3-row part's completions are short, the last is long: token counts differ too
    whole, _ = grpo_loss(logps, old, ref, adv, mask, beta=0.04, **options)
    (whole_grad,) = torch.autograd.grad(whole, logps)
    denominator = loss_denominator(mask, options["loss_type"], options.get("max_completion_length"))
    parts = [grpo_loss(logps[r], old[r], ref[r], adv[r], mask[r], beta=0.04, denominator=denominator, **options)[0]
             for r in (slice(0, 3), slice(3, 4))]
    (parts_grad,) = torch.autograd.grad(sum(parts), logps)
    assert sum(parts).item() == pytest.approx(whole.item(), rel=1e-6)
    assert torch.allclose(parts_grad, whole_grad, rtol=1e-5, atol=1e-8)
    own = [grpo_loss(logps[r], old[r], ref[r], adv[r], mask[r], beta=0.04, **options)[0]
           for r in (slice(0, 3), slice(3, 4))]
    (own_grad,) = torch.autograd.grad(sum(own) / 2, logps)  # each rank's own mean, then DeepSpeed's average
    assert not torch.allclose(own_grad, whole_grad, rtol=1e-3)


# Four rows of 5, 2, 3 and 1 kept tokens (C = 5), each with its own advantage. At ratio 1 and beta 0 a kept token's
# loss is -A (cispo: -A * logp), so each normalisation gives its own number.
ROW_LENGTHS, ROW_ADVANTAGES, MAX_LEN = [5, 2, 3, 1], [1.0, -0.5, 2.0, -1.5], 8  # MAX_LEN: --max_new_tokens


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"])
def test_each_loss_types_normalisation_is_its_stated_definition(loss_type):
    """grpo: the mean over sequences of each sequence's token mean; bnpo, dapo, cispo: the sum over every kept token
    / the batch's kept tokens; dr_grpo: the sum / (sequences x max_completion_length). TRL (1.16.0) on the same
    batch in two micro-batches of two rows (gradient_accumulation_steps = steps_per_generation = 2, one process)
    gives the same number but for bnpo, whose micro-batches each divide by their own tokens (7 and 4)."""
    logps = -torch.rand(4, 5, generator=torch.Generator().manual_seed(0)) - 0.1  # (B, C)
    mask = torch.tensor([[1.0] * n + [0.0] * (5 - n) for n in ROW_LENGTHS])
    loss, _ = grpo_loss(logps, logps, None, torch.tensor(ROW_ADVANTAGES), mask, beta=0.0, loss_type=loss_type,
                        max_completion_length=MAX_LEN)
    token = [[-a * (logps[i, t].item() if loss_type == "cispo" else 1.0) for t in range(n)]  # each kept token's loss
             for i, (n, a) in enumerate(zip(ROW_LENGTHS, ROW_ADVANTAGES))]
    total, tokens = sum(map(sum, token)), sum(ROW_LENGTHS)
    stated = {"grpo": sum(sum(row) / len(row) for row in token) / len(token),
              "dr_grpo": total / (len(token) * MAX_LEN)}.get(loss_type, total / tokens)
    assert loss.item() == pytest.approx(stated, rel=1e-6)

    parts = [token[:2], token[2:]]  # TRL: each micro-batch's loss / gradient_accumulation_steps, summed
    trl = {"grpo": sum(sum(sum(row) / len(row) for row in p) / len(p) for p in parts) / 2,
           "bnpo": sum(sum(map(sum, p)) / sum(map(len, p)) for p in parts) / 2,
           "dr_grpo": sum(sum(map(sum, p)) / (len(p) * MAX_LEN) for p in parts) / 2,
           # num_items_in_batch: the whole generation batch's tokens, / num_processes x grad_accum / steps_per_generation
           "dapo": sum(sum(map(sum, p)) / (tokens / 1 * 2 / 2) for p in parts)}
    trl["cispo"] = trl["dapo"]
    assert (loss.item() == pytest.approx(trl[loss_type], rel=1e-6)) == (loss_type != "bnpo")


def test_a_part_that_keeps_no_token_adds_no_extremes_to_the_step():
    """Parts folded by add_part_stats (micro-batches, ranks): one whose every token is masked has no ratio nor TIS
    weight to report, so the step's min and max are the other part's, here all above 1."""
    from simple_grpo.run.metrics import add_part_stats
    logps = torch.full((2, 3), -1.0)
    old, sampler = logps - 0.2, logps - 0.3  # ratio e^0.2 on every token, TIS weight e^0.1
    stats = {}
    for mask in (torch.zeros(2, 3), torch.ones(2, 3)):  # the empty part first, as rank 0's could be
        _, part = grpo_loss(logps, old, None, torch.tensor([1.0, -1.0]), mask, beta=0.0, sampler_logps=sampler)
        add_part_stats(stats, part, mask.sum().item() / 6)
    assert stats["ratio_min"] == pytest.approx(math.exp(0.2)) == stats["ratio_max"]
    assert stats["is_weight_min"] == pytest.approx(math.exp(0.1)) == stats["is_weight_max"]
    assert stats["ratio_mean"] == pytest.approx(math.exp(0.2))
