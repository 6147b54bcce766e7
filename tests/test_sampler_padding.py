"""vLLM's log-probs past the end of a completion: vllm_sampler.NO_LOGP, a value no log-prob can be (vLLM reports
exactly 0.0 for a token it is sure of, so 0 cannot mark its padding). It marks where each completion ends
(generated_lengths) across the wire (check_rollout, encode, decode) and collate; the masks keep nothing past that
end, whatever the stop set and whatever token pads the row, so the loss never reads the marker. A hand-made batch:
tests/test_stop_set.py has the same on real vLLM batches, one of them ended by vLLM's context."""
import pytest
import torch

from grpo_math import completion_mask, grpo_loss, is_truncated
from simple_grpo.generation.vllm_sampler import NO_LOGP, generated_lengths
from simple_grpo.protocol import check_rollout, decode, encode
from simple_grpo.rollouts import collate, make_groups
from simple_grpo.run.doctor import sampler_gap_details

EOS, THINK_END = 2, 7  # vLLM stops at both EOS and </think>
PAD = EOS  # as Qwen's tokenizers pad with <|endoftext|>, a stop id: padding looks like a stop token
STOP_IDS = [EOS, THINK_END]
G = 2


def sampled():
    """What vllm_sampler.sample returns for 2 prompts x 2: completion_ids (4, 5) right-padded with PAD, and
    sampler_logps (4, 5) right-padded with NO_LOGP. Row 1 ends at </think>; row 3 is one vLLM's context ended after
    2 tokens (finish reason "length", no stop token); row 0's second token is one vLLM is sure of (0.0)."""
    rows = [[5, 8, EOS], [5, THINK_END], [5, 5, 5, 5, EOS], [6, 6]]
    completion_ids = torch.full((4, 5), PAD)
    sampler_logps = torch.full((4, 5), NO_LOGP)
    for i, row in enumerate(rows):
        completion_ids[i, :len(row)] = torch.tensor(row)
        sampler_logps[i, :len(row)] = -0.1 * torch.arange(1, len(row) + 1)
    sampler_logps[0, 1] = 0.0
    return [torch.tensor([3, 4]), torch.tensor([3, 4, 4])], completion_ids, sampler_logps


def served_batch():
    """The groups make_groups posts, through encode, the server's check and decode, collated as a trainer does."""
    prompt_rows, completion_ids, sampler_logps = sampled()
    until_stop = completion_mask(completion_ids, STOP_IDS, lengths=generated_lengths(sampler_logps))
    groups, _ = make_groups(prompt_rows, completion_ids, until_stop, torch.tensor([1.0, 0.0, 0.0, 1.0]), G,
                            {"policy_version": 0}, sampler_logps)
    served = []
    for tensors, meta in groups:
        check_rollout(tensors, meta, vocab_size=10, max_len=32, max_group_size=8)  # NO_LOGP is finite
        got, _ = decode(encode(tensors, meta))
        assert torch.equal(got["sampler_logps"], tensors["sampler_logps"])
        served.append(got)
    return collate(served, PAD)


def test_the_generated_lengths_survive_the_wire_and_collate():
    batch = served_batch()
    assert batch["sampler_logps"].shape == (4, 5)
    assert generated_lengths(batch["sampler_logps"]).tolist() == [3, 2, 5, 2]
    generated = torch.arange(5)[None, :] < torch.tensor([3, 2, 5, 2])[:, None]
    assert (batch["sampler_logps"][~generated] == NO_LOGP).all()  # sample's padding and collate's
    assert (batch["sampler_logps"][generated] <= 0).all() and batch["sampler_logps"][0, 1] == 0.0


def test_a_completion_the_context_ended_is_truncated_and_keeps_no_padding_though_pad_is_a_stop_id():
    batch = served_batch()
    lengths = generated_lengths(batch["sampler_logps"])
    assert is_truncated(batch["completion_ids"], STOP_IDS, lengths).tolist() == [False, False, False, True]
    assert completion_mask(batch["completion_ids"], STOP_IDS, lengths=lengths)[3].tolist() == [1, 1, 0, 0, 0]
    assert completion_mask(batch["completion_ids"], STOP_IDS, True, lengths)[3].tolist() == [0, 0, 0, 0, 0]
    # without the lengths its first padding token reads as its stop token: trained, and the row not truncated
    assert completion_mask(batch["completion_ids"], STOP_IDS)[3].tolist() == [1, 1, 1, 0, 0]
    assert not is_truncated(batch["completion_ids"], STOP_IDS)[3]


@pytest.mark.parametrize("stop_ids", [STOP_IDS, [EOS]], ids=["one_stop_set", "eos_only"])
@pytest.mark.parametrize("mask_truncated", [False, True])
@pytest.mark.parametrize("tis_cap", [2.0, 0.0])  # with --tis_cap 0, vLLM's log-probs are pi_old
def test_the_loss_never_reads_the_marker(stop_ids, mask_truncated, tis_cap):
    """Whatever the masks' stop set (EOS alone runs row 1 past </think>, over the padding) and whether truncated
    completions are trained: the marker replaced by any other value gives the same loss and the same figures."""
    batch = served_batch()
    sampler = batch["sampler_logps"]
    mask = completion_mask(batch["completion_ids"], stop_ids, mask_truncated, generated_lengths(sampler))
    assert not (mask.bool() & (sampler == NO_LOGP)).any()
    logps = -torch.rand(4, 5, generator=torch.Generator().manual_seed(0))
    elsewhere = sampler.masked_fill(sampler == NO_LOGP, -30.0)

    def loss_and_figures(sampler_logps):
        old = sampler_logps if tis_cap == 0 else logps
        loss, stats = grpo_loss(logps, old, None, batch["advantages"], mask, beta=0.0,
                                sampler_logps=None if tis_cap == 0 else sampler_logps, tis_cap=tis_cap)
        return loss, {**stats, **sampler_gap_details(batch["completion_ids"], mask, logps, sampler_logps)}
    (loss, figures), (same, same_figures) = loss_and_figures(sampler), loss_and_figures(elsewhere)
    assert torch.isfinite(loss) and torch.equal(loss, same) and figures == same_figures


def test_the_doctor_takes_a_sure_token_for_a_log_prob():
    batch = served_batch()
    mask = completion_mask(batch["completion_ids"], STOP_IDS, lengths=generated_lengths(batch["sampler_logps"]))
    logps = batch["sampler_logps"].clamp(max=0.0).clone()
    logps[0, 1] = -2.0  # the trainer is far less sure than vLLM of the token vLLM gave 0.0
    details = sampler_gap_details(batch["completion_ids"], mask, logps, batch["sampler_logps"])
    assert details["sampler_gap_rows"] == 1 and details["sampler_gap_max"] == 2.0
    assert (details["sampler_gap_pos"], details["sampler_gap_sampler_logp"], details["sampler_gap_trainer_logp"]) == \
        (1, 0.0, -2.0)


def test_a_batch_that_keeps_no_token_has_no_largest_gap():
    batch = served_batch()
    details = sampler_gap_details(batch["completion_ids"], torch.zeros(4, 5), batch["sampler_logps"],
                                  batch["sampler_logps"])
    assert details == {"sampler_gap_mean": 0.0, "sampler_gap_rows": 0}
