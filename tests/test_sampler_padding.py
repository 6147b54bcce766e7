"""vLLM's log-probs past the end of a completion: vllm_sampler.NO_LOGP, a value no log-prob can be (vLLM reports
exactly 0.0 for a token it is sure of, so 0 cannot mark its padding). The marker crosses the wire (check_rollout,
encode, decode) and collate, the loss never reads it, and the run doctor counts a kept one as a token vLLM never
sampled. A hand-made batch: tests/test_stop_set.py has the same on a real vLLM batch."""
import torch

from grpo_math import completion_mask, grpo_loss
from simple_grpo.generation.vllm_sampler import NO_LOGP
from simple_grpo.protocol import check_rollout, decode, encode
from simple_grpo.rollouts import collate, make_groups
from simple_grpo.run.doctor import sampler_gap_details

PAD, EOS, THINK_END = 0, 2, 7  # vLLM stops at both EOS and </think>
STOP_IDS = [EOS, THINK_END]
G = 2


def sampled():
    """What vllm_sampler.sample returns for 2 prompts x 2: completion_ids (4, 5) right-padded with PAD, and
    sampler_logps (4, 5) right-padded with NO_LOGP; row 1 ends at </think>, row 0's second token is one vLLM is
    sure of (0.0)."""
    rows = [[5, 8, EOS], [5, THINK_END], [5, 5, 5, 5, EOS], [6, EOS]]
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
    groups, _ = make_groups(prompt_rows, completion_ids, completion_mask(completion_ids, STOP_IDS),
                            torch.tensor([1.0, 0.0, 0.0, 1.0]), G, {"policy_version": 0}, sampler_logps)
    served = []
    for tensors, meta in groups:
        check_rollout(tensors, meta, vocab_size=10, max_len=32, max_group_size=8)  # NO_LOGP is finite
        got, _ = decode(encode(tensors, meta))
        assert torch.equal(got["sampler_logps"], tensors["sampler_logps"])
        served.append(got)
    return collate(served, PAD)


def test_the_padding_past_each_end_is_no_logp_after_the_wire_and_collate():
    batch = served_batch()
    ends = completion_mask(batch["completion_ids"], STOP_IDS).bool()
    assert batch["sampler_logps"].shape == (4, 5)
    assert (batch["sampler_logps"][~ends] == NO_LOGP).all()  # sample's padding (row 1) and collate's (rows 0, 1)
    assert (batch["sampler_logps"][ends] <= 0).all() and batch["sampler_logps"][0, 1] == 0.0


def test_the_loss_never_reads_the_marker():
    batch = served_batch()
    mask = completion_mask(batch["completion_ids"], STOP_IDS)
    logps, sampler = -torch.rand(4, 5, generator=torch.Generator().manual_seed(0)), batch["sampler_logps"]
    elsewhere = sampler.masked_fill(~mask.bool(), -3.0)
    for tis_cap in (2.0, 0.0):  # with --tis_cap 0, vLLM's log-probs are pi_old
        old = sampler if tis_cap == 0 else logps
        loss, stats = grpo_loss(logps, old, None, batch["advantages"], mask, beta=0.0,
                                sampler_logps=None if tis_cap == 0 else sampler, tis_cap=tis_cap)
        same, _ = grpo_loss(logps, elsewhere if tis_cap == 0 else logps, None, batch["advantages"], mask, beta=0.0,
                            sampler_logps=None if tis_cap == 0 else elsewhere, tis_cap=tis_cap)
        assert torch.isfinite(loss) and torch.equal(loss, same)


def test_the_doctor_takes_a_sure_token_for_a_log_prob_and_the_marker_for_no_log_prob():
    batch = served_batch()
    logps = batch["sampler_logps"].clamp(max=0.0).clone()
    logps[0, 1] = -2.0  # the trainer is far less sure than vLLM of the token vLLM gave 0.0
    agreed = sampler_gap_details(batch["completion_ids"], completion_mask(batch["completion_ids"], STOP_IDS), logps,
                                 batch["sampler_logps"])
    assert agreed["sampler_gap_unreported"] == 0 and agreed["sampler_gap_rows"] == 1
    assert (agreed["sampler_gap_pos"], agreed["sampler_gap_sampler_logp"], agreed["sampler_gap_trainer_logp"]) == \
        (1, 0.0, -2.0)
    # the trainer's masks know EOS alone: row 1 runs past </think> over sample's padding and collate's, 3 tokens
    # vLLM never sampled, whatever log-prob the trainer gives them
    eos_only = completion_mask(batch["completion_ids"], [EOS])
    assert eos_only[1].tolist() == [1, 1, 1, 1, 1]
    logps[1, 2:] = -0.5
    disagreed = sampler_gap_details(batch["completion_ids"], eos_only, logps, batch["sampler_logps"])
    assert disagreed["sampler_gap_unreported"] == 3
