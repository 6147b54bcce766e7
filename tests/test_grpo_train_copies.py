"""grpo_train.py held equal to the full trainer (python -m simple_grpo.train) at defaults: it copies the lesson's
task, the ref server's client, its flags and DeepSpeed's settings on purpose (it stands alone, with grpo_math.py),
and samples as simple_grpo/generation/hf_sampler.py does. These tests keep the copies honest, as tests/test_lesson.py
does for grpo_vllm_one.py; the checks both lessons share (imports, stop set, prompt, reward) run there for both."""
import dataclasses
import os
import random
import uuid

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpo_train
from grpo_math import completion_mask
from simple_grpo import protocol
from simple_grpo.generation import hf_sampler
from simple_grpo.rollouts import collate, make_groups, score_groups
from simple_grpo.task import problems, rewards
from simple_grpo.train import Config
from simple_grpo.trainer.deepspeed_engine import flag_config, make_engine
from simple_grpo.trainer.update import grpo_update
from tests.global_batch_step import whole_weights
from tests.test_lesson import SMOLLM2, a_group, close, full_config, same_moves
from tests.test_ref_server import server  # noqa: F401 - fixture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "models", "tiny-math")
OWN_DEFAULTS = {"run_name": "demo", "threads": 2}  # where its runs go, and its CPU threads: today's grpo_train.py's
# a few of the flags grpo_train.py leaves to the full trainer, with a value each
FULL_TRAINERS = [["--use_peft"], ["--resume"], ["--loss_type", "dapo"], ["--num_iterations", "2"],
                 ["--micro_batch_groups", "1"], ["--report_to", "tensorboard"], ["--preflight"], ["--plan"],
                 ["--loss_impl", "triton"], ["--reward_file", "my_rewards.py"], ["--stop_on", "kl"]]


def test_its_flags_have_the_full_trainers_defaults():
    """Every flag grpo_train.py has, the full trainer has too, with the same value at defaults once the defaults
    that follow from other flags are filled in (lr for the model, ref_url), but for where its runs go and its
    threads (today's values)."""
    mine, theirs = grpo_train.parse_flags([]), full_config()
    for f in dataclasses.fields(grpo_train.Config):
        assert hasattr(theirs, f.name), f"--{f.name} is grpo_train.py's alone"
        want = OWN_DEFAULTS[f.name] if f.name in OWN_DEFAULTS else getattr(theirs, f.name)
        assert getattr(mine, f.name) == want, f.name
    assert mine.lr == theirs.lr == 1e-4
    assert grpo_train.parse_flags(["--model", SMOLLM2]).lr == full_config(model=SMOLLM2).lr == 1e-6


@pytest.mark.parametrize("flags", FULL_TRAINERS, ids=[f[0] for f in FULL_TRAINERS])
def test_a_full_trainer_flag_is_refused_by_name_with_the_full_trainers_command(flags):
    args = [*flags, "--steps", "3"]
    with pytest.raises(SystemExit) as refused:
        grpo_train.parse_flags(args)
    assert " ".join(flags) in str(refused.value)
    assert f"python -m simple_grpo.train {' '.join(args)}" in str(refused.value), refused.value
    assert hasattr(Config, flags[0][2:])  # the command it gives takes it


@pytest.mark.parametrize("flags", [["--zero_stage", "3"], ["--dtype", "float16"]])
def test_a_value_it_cannot_take_is_refused_by_name(flags):
    with pytest.raises(SystemExit, match=f"{flags[0]} {flags[1]}: grpo_train.py takes"):
        grpo_train.parse_flags(flags)


def test_several_ranks_are_refused_naming_the_full_trainer(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("SIMPLE_GRPO_RUNS", str(tmp_path))
    with pytest.raises(SystemExit, match="2 ranks: .* deepspeed --num_gpus 2 --module simple_grpo.train"):
        grpo_train.main(grpo_train.parse_flags([]))
    assert not os.listdir(tmp_path)  # refused before anything started


def test_the_problems_are_the_full_trainers():
    assert grpo_train.load_problems(grpo_train.Config()) == problems.load_data(full_config())


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_deepspeed_config_is_the_full_trainers(stage, dtype):
    mine = grpo_train.deepspeed_config(grpo_train.parse_flags(["--zero_stage", str(stage), "--dtype", dtype]))
    assert mine == flag_config(full_config(zero_stage=stage, dtype=dtype))


def sample_both(model, tokenizer, prompts, min_new_tokens):
    """grpo_train.generate's and hf_sampler.generate's samples, each from torch's seed 0."""
    stop_ids = problems.stop_token_ids(tokenizer, "chat", TINY)
    torch.manual_seed(0)
    flags = {"num_generations": 4, "max_new_tokens": 24, "min_new_tokens": min_new_tokens}
    mine = grpo_train.generate(model, tokenizer, prompts, grpo_train.Config(**flags), stop_ids)
    torch.manual_seed(0)
    theirs = hf_sampler.generate(model, tokenizer, prompts, full_config(**flags), stop_ids)
    return mine, theirs


@pytest.mark.parametrize("min_new_tokens", [0, 24])  # 24: every completion is 24 tokens (a benchmark's)
def test_the_sampler_is_hf_samplers_token_for_token(min_new_tokens):
    """The copy samples what simple_grpo/generation/hf_sampler.py samples (the prompt run once, its keys and
    values copied G times), from the same seed: every token, and the padded prompts."""
    tokenizer, model = AutoTokenizer.from_pretrained(TINY), AutoModelForCausalLM.from_pretrained(TINY)
    prompts = [grpo_train.make_prompt(tokenizer, p["question"]) for p in grpo_train.load_problems(
        grpo_train.Config())[:2]]
    mine, theirs = sample_both(model, tokenizer, prompts, min_new_tokens)
    for a, b in zip(mine, theirs):
        assert torch.equal(a, b)
    assert mine[2].size(0) == 2 * 4 and model.training
    if min_new_tokens:
        assert mine[2].size(1) == 24 and (mine[2] != tokenizer.pad_token_id).all()  # G per prompt; the model back in training mode


def test_the_sampler_draws_from_the_temperature_softmax_whatever_the_models_generation_config_says():
    """A repetition penalty and a top-k in the model's generation_config change no token grpo_train.generate
    draws: it samples from softmax(logits / T), the distribution grpo_math.completion_logps computes."""
    tokenizer, model = AutoTokenizer.from_pretrained(TINY), AutoModelForCausalLM.from_pretrained(TINY)
    prompts = [grpo_train.make_prompt(tokenizer, p["question"]) for p in grpo_train.load_problems(
        grpo_train.Config())[:2]]
    stop_ids = grpo_train.stop_token_ids(tokenizer, TINY)
    sampled = []
    for penalty, top_k in ((None, None), (3.0, 5)):  # the tiny model's own config sets neither
        model.generation_config.repetition_penalty, model.generation_config.top_k = penalty, top_k
        torch.manual_seed(0)
        sampled.append(grpo_train.generate(model, tokenizer, prompts, grpo_train.Config(num_generations=4,
                                                                                         max_new_tokens=24),
                                           stop_ids)[2])
    assert torch.equal(*sampled)
    assert model.generation_config.repetition_penalty == 3.0  # the model's own config is left as it was


def test_the_wire_is_the_full_trainers_both_ways(server):  # noqa: F811
    """A group grpo_train.py posts comes back to the full trainer's client, and one the full trainer posts to
    grpo_train.py's, through a live ref_server.py, with the same meta and the server's ref_logps."""
    mine, full_cfg = grpo_train.parse_flags(["--ref_url", server]), full_config(ref_url=server)
    for post, take in (("grpo_train", "full"), ("full", "grpo_train")):
        run_id, group = uuid.uuid4().hex, a_group()
        meta = {"run_id": run_id, "policy_version": 3, "temperature": 0.7}
        if post == "grpo_train":
            grpo_train.post_group(mine, group, meta)
        else:
            protocol.post_groups(full_cfg, [(group, meta)])
        if take == "grpo_train":
            got, got_meta = grpo_train.take_group(mine, run_id, 60)
        else:
            got, got_meta = protocol.take_group(full_cfg, run_id, 60)
        assert got_meta == {"version": protocol.VERSION, **meta}, (post, take)
        assert set(got) == set(group) | {"ref_logps"} and got["ref_logps"].shape == (4, 5)
        for key, value in group.items():
            assert torch.equal(got[key], value), (post, take, key)


def test_a_steps_batch_masks_and_reference_are_the_full_trainers(server, monkeypatch, tmp_path):  # noqa: F811
    """grpo_train.main's first step, as it hands its batch to grpo_step, against what the full trainer builds
    from the same sampled tokens: its groups (make_groups), their reference log-probs from the same ref server,
    the batch (collate) and its loss mask; equal wherever the loss counts a token."""
    seen, real_generate, real_step = {}, grpo_train.generate, grpo_train.grpo_step

    def generate(*args):
        seen["sampled"] = real_generate(*args)
        return seen["sampled"]

    def grpo_step(engine, batch, loss_mask, cfg):
        seen["batch"], seen["loss_mask"] = batch, loss_mask
        return real_step(engine, batch, loss_mask, cfg)
    monkeypatch.setattr(grpo_train, "generate", generate)
    monkeypatch.setattr(grpo_train, "grpo_step", grpo_step)
    monkeypatch.setenv("SIMPLE_GRPO_RUNS", str(tmp_path))
    mine = grpo_train.parse_flags(["--ref_url", server, "--steps", "1", "--threads", "1", "--run_name", "copies"])
    grpo_train.main(mine)
    batch, loss_mask = seen["batch"], seen["loss_mask"]

    cfg, tokenizer = full_config(ref_url=server), AutoTokenizer.from_pretrained(TINY)
    G, stop_ids = cfg.num_generations, problems.stop_token_ids(tokenizer, "chat", TINY)
    prompt_ids, prompt_mask, completion_ids = seen["sampled"]
    until_stop = completion_mask(completion_ids, stop_ids)
    texts = tokenizer.batch_decode(completion_ids.masked_fill(until_stop == 0, tokenizer.pad_token_id),
                                   skip_special_tokens=True)
    drawn = random.Random(cfg.seed).sample(problems.load_data(cfg), cfg.batch_prompts)  # grpo_train's draws
    rewards_, _ = score_groups(texts, drawn, G, rewards.parse_reward_spec(cfg.reward_funcs, cfg.reward_weights))
    run_id = uuid.uuid4().hex
    groups, _ = make_groups([ids[m.bool()] for ids, m in zip(prompt_ids, prompt_mask)], completion_ids, until_stop,
                            rewards_, G, {"run_id": run_id, "policy_version": 0, "temperature": cfg.temperature},
                            eps=cfg.advantage_eps)
    assert groups, "no group had signal at step 1"
    protocol.post_groups(cfg, groups)
    theirs = collate([protocol.take_group(cfg, run_id, 60)[0] for _ in groups], tokenizer.pad_token_id)
    their_mask = completion_mask(theirs["completion_ids"], stop_ids)
    C = their_mask.size(1)  # the longest kept completion; grpo_train.py's batch keeps the sampled width
    assert torch.equal(loss_mask[:, :C], their_mask) and not loss_mask[:, C:].any()
    kept = their_mask.bool()
    for key in ("completion_ids", "ref_logps"):
        assert torch.equal(batch[key][:, :C][kept], theirs[key][kept]), key
    assert torch.equal(batch["advantages"], theirs["advantages"])
    for mine_row, m, their_row, their_m in zip(batch["prompt_ids"], batch["prompt_mask"], theirs["prompt_ids"],
                                               theirs["prompt_mask"]):
        assert torch.equal(mine_row[m.bool()], their_row[their_m.bool()])


# ---------------------------------------------------------------------------- one update on a fixed batch
FIGURES = ("loss", "kl", "clip_fraction", "ratio_mean", "entropy", "grad_norm")


@pytest.mark.parametrize("stage", [0, 2])
def test_one_update_is_the_full_trainers(stage):
    """grpo_train.grpo_step on a fixed batch (4 groups, completions of different lengths, reference log-probs
    near the policy's) against the full trainer's grpo_update on one rank (no sampler log-probs: the policy
    sampled), each on a fresh engine from the same weights: every figure within 1e-5 relative, every weight's
    move allclose."""
    import deepspeed
    from tests.lesson_step import fixed_batch
    full_cfg = full_config(zero_stage=stage, threads=1, lr=1e-4)
    engine, tokenizer = make_engine(full_cfg)
    mine_cfg = grpo_train.parse_flags(["--zero_stage", str(stage), "--threads", "1"])
    model = AutoModelForCausalLM.from_pretrained(mine_cfg.model, dtype=torch.float32)
    mine_engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=grpo_train.deepspeed_config(mine_cfg))
    mine_engine.train()
    batch, _ = fixed_batch(engine, tokenizer.eos_token_id)
    batch.pop("sampler_logps")
    loss_mask = completion_mask(batch["completion_ids"], [tokenizer.eos_token_id])
    before = whole_weights(mine_engine)
    mine, _ = grpo_train.grpo_step(mine_engine, dict(batch), loss_mask, mine_cfg)
    moved = whole_weights(mine_engine) - before
    before = whole_weights(engine)
    theirs, _ = grpo_update(engine, {**batch, "loss_mask": loss_mask}, full_cfg)
    their_moved = whole_weights(engine) - before
    assert theirs["kl"] > 0 and theirs["grad_norm"] > 0
    for key in FIGURES:
        assert close(mine[key], theirs[key]), (key, mine[key], theirs[key])
    assert same_moves(moved.numpy(), their_moved.numpy())
