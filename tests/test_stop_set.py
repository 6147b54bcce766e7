"""One stop set: vLLM, transformers' generate and every mask agree on where a completion ends, for a model whose
generation config lists eos ids its tokenizer does not call EOS (as Qwen2.5-Instruct's lists <|endoftext|>
beside <|im_end|>, and the random-weight bench models Qwen's 151643). vLLM stops at those ids whatever stop
ids it is given; a mask that did not know them ran over the padding, trained the padded tail with the
completion's advantage, and compared it with sampler log-probs of 0 (the 12-17 nat gaps of the first 7B run).
The run doctor's mismatch rule names what it sees on the same batch: quiet when healthy, loud when the weights
never reached vLLM, and a token vLLM is sure of (log-prob 0.0) is one outlier, not a mismatch. A batch whose
requests vLLM ended at its context length (--max_model_len) trains none of its padding.

The tiny model, copied with a generation config whose eos ids are [EOS, </think>]: every completion of the
warm-started tiny model writes </think>, so each one ends there, long before --max_new_tokens."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_math import completion_mask, grpo_loss, is_truncated
from simple_grpo.train import Config
from simple_grpo.generation.hf_sampler import generate
from simple_grpo.generation.vllm_sampler import check_context_length, generated_lengths
from simple_grpo.logprobs import sequence_logps
from simple_grpo.run.doctor import RunDoctor, sampler_gap_details
from simple_grpo.task.problems import load_jsonl, make_prompt, stop_token_ids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "models", "tiny-math")
DATA = os.path.join(ROOT, "data", "toy_math", "train.jsonl")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model whose generation_config.json also ends a completion at </think>, an id that is not its
    tokenizer's EOS."""
    out = tmp_path_factory.mktemp("extra_eos")
    for name in os.listdir(TINY):
        shutil.copy(os.path.join(TINY, name), out)
    think_end = AutoTokenizer.from_pretrained(TINY).convert_tokens_to_ids("</think>")
    path = out / "generation_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "eos_token_id": [config["eos_token_id"], think_end]}))
    return str(out)


def config(model_dir, dtype):
    return Config(model=model_dir, dataset=DATA, dtype=dtype, batch_prompts=4, num_generations=4, max_new_tokens=48)


def prompts(tokenizer, n=4):
    return [make_prompt(tokenizer, p["question"]) for p in load_jsonl(DATA)[:n]]


def ends_where_the_mask_ends(completion_ids, mask, stop_ids, pad_id):
    """Each completion's mask ends at its stop token (nothing but padding after it) or runs to the length limit
    with no stop token (cut off); returns how many ended at a stop id that is not the tokenizer's EOS."""
    C, at_extra = completion_ids.size(1), 0
    for row, truncated, n in zip(completion_ids, is_truncated(completion_ids, stop_ids), mask.sum(1).long()):
        if truncated:
            assert n == C
            continue
        assert row[n - 1].item() in stop_ids and (row[n:] == pad_id).all(), row.tolist()
        at_extra += row[n - 1].item() != stop_ids[0]
    return at_extra


def test_the_stop_set_holds_the_generation_configs_eos_ids(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert stop_token_ids(tok, "chat", model_dir) == [tok.eos_token_id, tok.convert_tokens_to_ids("</think>")]
    assert stop_token_ids(tok) == stop_token_ids(tok, "chat", model_dir)  # the tokenizer's own directory
    assert stop_token_ids(AutoTokenizer.from_pretrained(TINY)) == [tok.eos_token_id]  # the tiny default: EOS alone


# vLLM runs in a process of its own: an engine in this one, stopped or collected, destroys the torch.distributed
# group that in-process DeepSpeed engines made earlier in the suite still hold (tests/test_trainer_options.py)
SAMPLE = """
import json, sys
from safetensors.torch import save_file
from simple_grpo.train import Config
from simple_grpo.generation.vllm_sampler import sample, start_vllm
from simple_grpo.task.problems import load_jsonl, make_prompt
cfg = Config(**json.loads(sys.argv[1]))
llm = start_vllm(cfg, max_seqs=16)
tok = llm.get_tokenizer()
prompts = [make_prompt(tok, p["question"]) for p in load_jsonl(cfg.dataset)[:4]]
prompt_rows, completion_ids, sampler_logps = sample(llm, prompts, cfg)  # stop_ids: cfg.model's
try:
    sample(llm, prompts, cfg, stop_ids=[tok.eos_token_id])
    refusal = ""
except RuntimeError as e:
    refusal = str(e)
tensors = {f"prompt_{i}": row for i, row in enumerate(prompt_rows)}
save_file({**tensors, "completion_ids": completion_ids, "sampler_logps": sampler_logps}, sys.argv[2],
          metadata={"refusal": refusal})
"""


def sampled(model_dir, dtype, tmp_path):
    """vLLM's completions of 4 prompts x 4 with the whole stop set (vLLM's seed: cfg.seed), and what sample says when
    given the tokenizer's EOS alone: (cfg, tokenizer, prompt_rows, completion_ids, sampler_logps, the refusal)."""
    cfg = config(model_dir, dtype)
    out = str(tmp_path / f"sampled_{dtype}.safetensors")
    done = subprocess.run([sys.executable, "-c", SAMPLE, json.dumps({"model": model_dir, "dataset": DATA,
                           "dtype": dtype, "batch_prompts": 4, "num_generations": 4, "max_new_tokens": 48}), out],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with safe_open(out, "pt") as f:
        refusal = f.metadata()["refusal"]
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    prompt_rows = [tensors[f"prompt_{i}"] for i in range(4)]
    tok = AutoTokenizer.from_pretrained(model_dir)
    return cfg, tok, prompt_rows, tensors["completion_ids"], tensors["sampler_logps"], refusal


@pytest.fixture(scope="module")
def bf16(model_dir, tmp_path_factory):
    return sampled(model_dir, "bfloat16", tmp_path_factory.mktemp("bf16"))


def trainer_logps(cfg, prompt_rows, completion_ids, pad_id, noise=0.0):
    """The trainer's log-probs of vLLM's completions (left-padded prompts, the shared-prompt forward), with its
    weights moved by `noise` (x N(0, 1)) when given: weights that never reached vLLM."""
    policy = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=getattr(torch, cfg.dtype)).eval()
    if noise:
        torch.manual_seed(1)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(noise * torch.randn_like(p))
    P = max(r.numel() for r in prompt_rows)
    prompt_ids = torch.stack([torch.cat([torch.full((P - r.numel(),), pad_id), r]) for r in prompt_rows])
    prompt_mask = torch.stack([(torch.arange(P) >= P - r.numel()).long() for r in prompt_rows])
    with torch.no_grad():
        return sequence_logps(policy, prompt_ids, prompt_mask, completion_ids, cfg.temperature).float()


def check_vllm_against_the_masks(model_dir, dtype, batch):
    """Tails masked, lengths right, and the sampler's log-probs those of the trainer within the precision's
    noise; stopping at the tokenizer's EOS alone, vLLM still ends completions at </think>, and sample stops
    the run naming it."""
    cfg, tok, prompt_rows, completion_ids, sampler_logps, refusal = batch
    think_end, stop_ids = tok.convert_tokens_to_ids("</think>"), stop_token_ids(tok, cfg.prompt_format, cfg.model)
    assert f"at token ids [{think_end}], outside the stop set [{tok.eos_token_id}]" in refusal
    mask = completion_mask(completion_ids, stop_ids)
    assert ends_where_the_mask_ends(completion_ids, mask, stop_ids, tok.pad_token_id) > 0  # some at </think>
    logps = trainer_logps(cfg, prompt_rows, completion_ids, tok.pad_token_id)
    gap = ((logps - sampler_logps).abs() * mask)
    print(f"{dtype}: sampler gap mean {gap.sum().item() / mask.sum().item():.2e}, max {gap.max().item():.2e}")
    assert gap.max().item() <= (1e-3 if dtype == "float32" else 0.1)
    # a mask from the tokenizer's stop ids alone runs past </think> over the padding, where vLLM generated nothing;
    # bounded by what vLLM generated, it keeps exactly the tokens vLLM sampled (the rows ended at </think> whole)
    eos_only, lengths = stop_token_ids(AutoTokenizer.from_pretrained(TINY)), generated_lengths(sampler_logps)
    generated = torch.arange(completion_ids.size(1))[None, :] < lengths[:, None]
    assert (completion_mask(completion_ids, eos_only).bool() & ~generated).any()
    assert torch.equal(completion_mask(completion_ids, eos_only, lengths=lengths).bool(), generated)


def test_vllm_completions_end_where_the_masks_end_them_and_match_the_trainer_in_bf16(model_dir, bf16):
    check_vllm_against_the_masks(model_dir, "bfloat16", bf16)


@pytest.mark.slow  # ~25 s: a vLLM start of its own
def test_vllm_completions_end_where_the_masks_end_them_and_match_the_trainer_in_fp32(model_dir, tmp_path):
    check_vllm_against_the_masks(model_dir, "float32", sampled(model_dir, "float32", tmp_path))


# ---------------------------------------------------------------------------- completions ended by vLLM's context
CONTEXT = 150  # the tiny world's prompts are 109-146 tokens: with 48 new tokens most requests reach it


@pytest.fixture(scope="module")
def context_cut(tmp_path_factory):
    """vLLM's completions of 4 prompts x 4 in float32 with --max_model_len CONTEXT: many end at the context's end,
    with finish reason "length" and no stop token, short of --max_new_tokens."""
    out = str(tmp_path_factory.mktemp("context") / "sampled.safetensors")
    flags = {"model": TINY, "dataset": DATA, "dtype": "float32", "batch_prompts": 4, "num_generations": 4,
             "max_new_tokens": 48, "max_model_len": CONTEXT}
    done = subprocess.run([sys.executable, "-c", SAMPLE, json.dumps(flags), out], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with safe_open(out, "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    return Config(**flags), [tensors[f"prompt_{i}"] for i in range(4)], tensors["completion_ids"], tensors["sampler_logps"]


def test_completions_that_vllms_context_ended_are_truncated_and_train_no_padding(context_cut):
    cfg, prompt_rows, completion_ids, sampler_logps = context_cut
    tok = AutoTokenizer.from_pretrained(TINY)
    stop_ids, lengths = stop_token_ids(tok), generated_lengths(sampler_logps)
    room = torch.tensor([CONTEXT - len(row) for row in prompt_rows]).repeat_interleave(4)  # (Q*G,)
    truncated = is_truncated(completion_ids, stop_ids, lengths)
    cut = truncated & (lengths < cfg.max_new_tokens)
    print(f"{int(cut.sum())} of {len(lengths)} completions ended by the context; room {room.tolist()}, "
          f"generated {lengths.tolist()}")
    assert cut.any() and torch.equal(lengths[cut], room[cut])  # each ended exactly at the context's end
    assert (lengths <= room).all()
    mask = completion_mask(completion_ids, stop_ids, lengths=lengths)
    assert torch.equal(mask.sum(1).long()[truncated], lengths[truncated])  # every generated token, none past them
    assert not completion_mask(completion_ids, stop_ids, True, lengths)[truncated].any()  # --mask_truncated_completions
    # the trainer's log-probs of those tokens are vLLM's (float32): no marker, no padding among the kept tokens
    logps = trainer_logps(cfg, prompt_rows, completion_ids, tok.pad_token_id)
    _, stats = grpo_loss(logps, logps, None, torch.randn(len(lengths)), mask, beta=0.0, sampler_logps=sampler_logps)
    gaps = sampler_gap_details(completion_ids, mask, logps, sampler_logps)
    print({k: round(v, 6) for k, v in {**stats, **gaps}.items()})
    assert gaps["sampler_gap_max"] <= 1e-3 and 0.99 <= stats["is_weight_min"] <= stats["is_weight_max"] <= 1.01
    # the mask made before: by the stop set alone, a cut row kept its padding (<|endoftext|>, vLLM's NO_LOGP)
    before = completion_mask(completion_ids, stop_ids)
    assert (before.bool() & ~mask.bool()).any()


def test_the_start_names_the_prompts_vllms_context_cannot_hold(context_cut, capsys):
    """check_context_length counts each prompt's tokens as vLLM did; it says how many leave less room than
    --max_new_tokens, and refuses where a prompt alone fills the context."""
    cfg, prompt_rows, _, _ = context_cut
    tok = AutoTokenizer.from_pretrained(TINY)
    problems = load_jsonl(DATA)[:4]
    lengths = [len(row) for row in prompt_rows]  # vLLM's prompt_token_ids
    check_context_length(cfg, problems, tok)
    short = sum(n + cfg.max_new_tokens > CONTEXT for n in lengths)
    said = capsys.readouterr().out
    assert short > 0 and (f"note: {short} of the 4 prompts of {DATA} are longer than --max_model_len {CONTEXT} - "
                          f"--max_new_tokens 48 = {CONTEXT - 48} tokens (the longest {max(lengths)})") in said
    check_context_length(dataclasses.replace(cfg, max_model_len=max(lengths) + 48), problems, tok)
    assert capsys.readouterr().out == ""
    full = sum(n >= min(lengths) + 1 for n in lengths)
    with pytest.raises(SystemExit, match=f"{full} of the 4 prompts .* are {min(lengths) + 1} tokens or longer "
                                         f"\\(the longest {max(lengths)}\\)"):
        check_context_length(dataclasses.replace(cfg, max_model_len=min(lengths) + 1), problems, tok)


# ---------------------------------------------------------------------------- the run doctor's mismatch rule
def doctor_verdict(tmp_path, cfg, completion_ids, mask, logps, sampler_logps, advantages):
    """The record the full trainer logs for this batch (grpo_loss's TIS figures, grpo_update's sampler_gap_details) and
    what the run doctor says of it: the mismatch message, or None."""
    _, stats = grpo_loss(logps, logps, None, advantages, mask, beta=0.0, sampler_logps=sampler_logps)
    record = {"step": 1, **stats, **sampler_gap_details(completion_ids, mask, logps, sampler_logps)}
    doctor = RunDoctor(dataclasses.replace(cfg, doctor_window=1), str(tmp_path / "metrics.jsonl"))
    doctor.step(record)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines() if (tmp_path / "metrics.jsonl").exists() else []
    warnings = [json.loads(line) for line in lines]
    assert [w["warning"] for w in warnings] in ([], ["mismatch"])
    return record, warnings[0]["message"] if warnings else None


def test_the_doctor_stays_quiet_on_a_healthy_bf16_batch(tmp_path, model_dir, bf16):
    cfg, tok, prompt_rows, completion_ids, sampler_logps, _ = bf16
    mask = completion_mask(completion_ids, stop_token_ids(tok, cfg.prompt_format, cfg.model))
    logps = trainer_logps(cfg, prompt_rows, completion_ids, tok.pad_token_id)
    record, message = doctor_verdict(tmp_path, cfg, completion_ids, mask, logps, sampler_logps,
                                     torch.randn(completion_ids.size(0)))
    assert message is None, message
    assert record["sampler_gap_rows"] == 0


def test_the_doctor_names_weights_that_did_not_reach_vllm(tmp_path, model_dir, bf16):
    cfg, tok, prompt_rows, completion_ids, sampler_logps, _ = bf16
    mask = completion_mask(completion_ids, stop_token_ids(tok, cfg.prompt_format, cfg.model))
    logps = trainer_logps(cfg, prompt_rows, completion_ids, tok.pad_token_id, noise=0.05)
    record, message = doctor_verdict(tmp_path, cfg, completion_ids, mask, logps, sampler_logps,
                                     torch.randn(completion_ids.size(0)))
    print(message)
    assert message is not None and record["sampler_gap_rows"] > 0
    assert f"this step {record['sampler_gap_rows']} completions hold a token off by more than 1 nat" in message
    assert f"the largest at token id {record['sampler_gap_token']}" in message
    assert "weights reach vLLM" in message and "stop-set" not in message


def test_a_token_vllm_is_sure_of_is_one_outlier_token_not_a_mismatch(tmp_path, model_dir, bf16):
    """vLLM reports a log-prob of exactly 0.0 for a token it is sure of (bf16 rounding): a log-prob, not its
    padding. One such token that the trainer gives less than e^-1 is one outlier token, not a mismatch: the doctor
    stays quiet (the batch's mean gap is small)."""
    cfg, tok, prompt_rows, completion_ids, sampler_logps, _ = bf16
    mask = completion_mask(completion_ids, stop_token_ids(tok, cfg.prompt_format, cfg.model))
    sure = mask.bool() & (sampler_logps == 0.0)
    print(f"{int(sure.sum())} of {int(mask.sum())} kept tokens have a vLLM log-prob of 0.0")
    assert sure.any()
    row, pos = sure.nonzero()[0].tolist()
    logps = trainer_logps(cfg, prompt_rows, completion_ids, tok.pad_token_id)
    logps[row, pos] = -1.5  # the trainer's log-prob of that token, below -1
    record, message = doctor_verdict(tmp_path, cfg, completion_ids, mask, logps, sampler_logps,
                                     torch.randn(completion_ids.size(0)))
    assert record["sampler_gap_rows"] == 1 and record["sampler_gap_pos"] == pos
    assert record["sampler_gap_sampler_logp"] == 0.0 and record["sampler_gap_trainer_logp"] == -1.5
    assert message is None, message


def test_transformers_generate_stops_at_the_same_ids(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = config(model_dir, "float32")
    stop_ids = stop_token_ids(tok, cfg.prompt_format, cfg.model)
    torch.manual_seed(0)
    _, _, completion_ids = generate(model, tok, prompts(tok, 2), cfg, stop_ids)
    mask = completion_mask(completion_ids, stop_ids)
    assert ends_where_the_mask_ends(completion_ids, mask, stop_ids, tok.pad_token_id) > 0
