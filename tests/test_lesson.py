"""The lesson, grpo_vllm_one.py, held equal to the full trainer (python -m simple_grpo.train) at defaults: the
lesson copies the task, the batch, DeepSpeed's and vLLM's settings and the wire on purpose (it stands alone), and
these tests are what keeps the copies honest. The 60-step runs of both: tests/test_lesson_run.py (slow)."""
import ast
import dataclasses
import json
import os
import subprocess
import sys
import uuid

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

import grpo_train
import grpo_vllm_one as lesson
from grpo_math import completion_mask
from simple_grpo import protocol
from simple_grpo.generation import vllm_sampler
from simple_grpo.rollouts import collate
from simple_grpo.task import problems, rewards
from simple_grpo.train import Config
from simple_grpo.trainer.config import check_options
from simple_grpo.trainer.deepspeed_engine import flag_config
from tests.test_ref_server import server  # noqa: F401 - fixture
from tools.fetch_smollm2 import model_dir as smollm2_dir
from tools.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
SMOLLM2 = smollm2_dir()
MODELS = [os.path.join(ROOT, "models", "tiny-math"),
          pytest.param(SMOLLM2, marks=pytest.mark.skipif(not os.path.isfile(os.path.join(SMOLLM2, "config.json")),
                                                         reason=f"SmolLM2 is not installed at {SMOLLM2} "
                                                                "(make smollm2, or $SIMPLE_GRPO_SMOLLM2)"))]
OWN_DEFAULTS = {"run_name"}  # where the lesson's runs go


def full_config(**flags):
    cfg = Config(**flags)
    check_options(cfg)  # fills in the defaults that depend on other flags (lr, epsilon_high, ...)
    return cfg


LESSONS = [pytest.param(lesson, id="grpo_vllm_one"), pytest.param(grpo_train, id="grpo_train")]  # the copies both hold


@pytest.mark.parametrize("script", ["grpo_vllm_one.py", "grpo_train.py"])
def test_the_lessons_import_from_the_project_only_grpo_math(script):
    tree = ast.parse(open(os.path.join(ROOT, script)).read())
    modules = {node.module if isinstance(node, ast.ImportFrom) else alias.name
               for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
               for alias in node.names}
    own = {m.split(".")[0] for m in modules} & {os.path.splitext(f)[0] for f in os.listdir(ROOT)}
    assert own == {"grpo_math"}, own  # triton_loss/ only through grpo_math.grpo_loss(impl="triton")


def test_the_lessons_flags_have_the_full_trainers_defaults():
    """Every flag the lesson has, the full trainer has too, with the same value at defaults once the defaults that
    follow from other flags are filled in (lr for the model, ref_url), but for where the lesson's runs go."""
    mine, theirs = lesson.Config(), full_config()
    for f in dataclasses.fields(lesson.Config):
        assert hasattr(theirs, f.name), f"--{f.name} is the lesson's alone"
        if f.name not in OWN_DEFAULTS:
            assert getattr(mine, f.name) == getattr(theirs, f.name), f.name
    assert mine.lr == theirs.lr == 1e-4
    assert lesson.Config(model=SMOLLM2).lr == full_config(model=SMOLLM2).lr == 1e-6


def test_a_full_trainer_flag_is_refused_by_name_with_the_full_trainers_command():
    out = subprocess.run([sys.executable, "grpo_vllm_one.py", "--use_peft", "--steps", "3"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--use_peft" in out.stderr and "python -m simple_grpo.train --use_peft --steps 3" in out.stderr, out.stderr


@pytest.mark.parametrize("flags", [["--zero_stage", "3"], ["--dtype", "float16"], ["--loss_impl", "cuda"],
                                   ["--tis_cap", "0.0"]])
def test_a_value_the_lesson_cannot_take_is_refused_by_name(flags):
    out = subprocess.run([sys.executable, "grpo_vllm_one.py", *flags], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and f"{flags[0]} {flags[1]}" in out.stderr, out.stderr


@pytest.mark.parametrize("script", LESSONS)
@pytest.mark.parametrize("model", MODELS)
def test_the_stop_set_and_the_prompt_are_the_full_trainers(model, script):
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert script.stop_token_ids(tokenizer, model) == problems.stop_token_ids(tokenizer, "chat", model)
    assert script.SYSTEM_PROMPT == problems.SYSTEM_PROMPT
    for question in ("What is 2 + 3?", "A farmer has 17 sheep.\nAll but 9 run away. How many are left?"):
        assert script.make_prompt(tokenizer, question) == problems.make_prompt(tokenizer, question)


ANSWER = "She has 3 + 4 = 7 apples.\n#### 1,007"
COMPLETIONS = [
    "<think>3 + 4</think><answer>1007</answer>", "<think>x</think><answer>1,007</answer>",
    " <think>x</think>\n<answer> 1007 </answer>\n", "<think>x</think><answer>1007.0</answer>",
    "<think>x</think><answer>$1007$</answer>", "<think>x</think><answer>1000 + 7</answer>",
    "<think>x</think><answer>1008</answer>", "<answer>1007</answer>", "<think>x</think>1007",
    "<think>x</think><answer>7</answer><answer>1007</answer>", "<think>x</think><answer>1007</answer> trailing",
    "<think><think>x</think><answer>1007</answer>", "<think>x</think><answer></answer>",
    "<think>x</think><answer>   </answer>", "<think>x</think><answer>one thousand seven</answer>",
    "<think>x</think><answer>\\boxed{1007}</answer>", "<think>x</think><answer>1007</answer></answer>",
    "", "<answer>1007</answer><think>x</think>", "<think>x</think><answer>-1007</answer>",
    "<think>x</think><answer>1e3</answer>", "<think>\n\n</think>\n<answer>\n1007\n</answer>",
    "<think>x</think><answer>1007", "<think>x</think><answer>10 07</answer>", "<THINK>x</THINK><ANSWER>1007</ANSWER>",
]


@pytest.mark.parametrize("script", LESSONS)
def test_the_reward_is_the_full_trainers_on_adversarial_completions(script):
    weights = rewards.parse_reward_spec(Config.reward_funcs, Config.reward_weights)
    for text in COMPLETIONS:
        theirs = rewards.score(text, rewards.true_answer(ANSWER), weights)
        assert script.score(text, ANSWER) == {k: theirs[k] for k in ("correctness", "format", "reward")}, text
    assert {script.score(t, ANSWER)["reward"] for t in COMPLETIONS} == {0.0, 0.5, 1.0, 1.5}  # every case met


def groups_as_posted(pad_id, stop_id):
    """Three groups as both workers post them (their own lengths), with the ref server's ref_logps added."""
    g, groups = torch.Generator().manual_seed(1), []
    for P, C in ((5, 4), (9, 7), (7, 1)):
        ids = torch.randint(3, 500, (4, C), generator=g)
        ids[0, C - 1] = stop_id
        logps = -torch.rand(4, C, generator=g)
        logps[1:, C - 1:] = vllm_sampler.NO_LOGP  # rows 1-3 generated C - 1 tokens
        ids[1:, C - 1:] = pad_id
        groups.append({"prompt_ids": torch.randint(3, 500, (P,), generator=g), "completion_ids": ids,
                       "sampler_logps": logps, "ref_logps": -torch.rand(4, C, generator=g),
                       "advantages": torch.randn(4, generator=g), "rewards": torch.rand(4, generator=g)})
    return groups


def test_the_batch_and_its_masks_are_the_full_trainers():
    tokenizer = AutoTokenizer.from_pretrained(lesson.Config.model)
    stop_ids = problems.stop_token_ids(tokenizer)
    groups = groups_as_posted(tokenizer.pad_token_id, stop_ids[0])
    mine, theirs = lesson.collate(groups, tokenizer.pad_token_id), collate(groups, tokenizer.pad_token_id)
    assert set(mine) == set(theirs)
    for key in theirs:
        assert mine[key].dtype == theirs[key].dtype and torch.equal(mine[key], theirs[key]), key
    lengths = (mine["sampler_logps"] != lesson.NO_LOGP).sum(1)
    assert torch.equal(lengths, vllm_sampler.generated_lengths(theirs["sampler_logps"]))
    assert torch.equal(completion_mask(mine["completion_ids"], stop_ids, lengths=lengths),
                       completion_mask(theirs["completion_ids"], stop_ids, lengths=lengths))
    assert lesson.NO_LOGP == vllm_sampler.NO_LOGP


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_deepspeed_config_is_the_full_trainers(stage, dtype):
    mine = lesson.deepspeed_config(lesson.Config(zero_stage=stage, dtype=dtype))
    assert mine == flag_config(full_config(zero_stage=stage, dtype=dtype))


@pytest.mark.parametrize("model", MODELS)
def test_the_vllm_settings_are_the_full_trainers(model):
    """The engine's arguments and the sampling parameters, as the full trainer's generation worker gives them."""
    cfg = full_config(model=model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    stop_ids = problems.stop_token_ids(tokenizer, "chat", model)
    engine, sampling = lesson.vllm_args(lesson.Config(model=model), False, stop_ids)  # on its own GPU
    assert engine == vllm_sampler.engine_args(cfg, compile=cfg.gen_compile,
                                              max_seqs=cfg.batch_prompts * cfg.num_generations)
    assert sampling == vllm_sampler.sampling_args(cfg, stop_ids)


def a_group():
    g = torch.Generator().manual_seed(2)
    return {"prompt_ids": torch.randint(3, 500, (6,), generator=g),
            "completion_ids": torch.randint(3, 500, (4, 5), generator=g),
            "advantages": torch.randn(4, generator=g), "rewards": torch.rand(4, generator=g),
            "sampler_logps": -torch.rand(4, 5, generator=g)}


def test_the_wire_is_the_full_trainers_both_ways(server):  # noqa: F811
    """A group the lesson posts comes back to the full trainer's client, and one the full trainer posts to the
    lesson's, through a live ref_server.py, with the same meta and the server's ref_logps (protocol version 2)."""
    lesson_cfg = lesson.Config(ref_url=server)
    full_cfg = full_config(ref_url=server)
    for post, take in (("lesson", "full"), ("full", "lesson")):
        run_id, group = uuid.uuid4().hex, a_group()
        meta = {"run_id": run_id, "policy_version": 3, "temperature": 0.7, "groups_in_batch": 1, "worker": 0}
        if post == "lesson":
            lesson.post_group(lesson_cfg, group, meta)
        else:
            protocol.post_groups(full_cfg, [(group, meta)])
        if take == "lesson":
            got, got_meta = lesson.take_group(lesson_cfg, run_id, 60, None)
        else:
            got, got_meta = protocol.take_group(full_cfg, run_id, 60)
        assert got_meta == {"version": protocol.VERSION, **meta}, (post, take)
        assert set(got) == set(group) | {"ref_logps"} and got["ref_logps"].shape == (4, 5)
        for key, value in group.items():
            assert torch.equal(got[key], value), (post, take, key)


# ---------------------------------------------------------------------------- one update on a fixed batch
def update_run(tmp_path, ranks, stage):
    """tests/lesson_step.py on 1 rank (plain python) or 2 (the deepspeed launcher): {"lesson"|"full": (figures,
    how far each weight moved)}."""
    out_dir = tmp_path / f"ranks{ranks}_zero{stage}"
    script = [os.path.join(ROOT, "tests", "lesson_step.py"), str(stage), str(out_dir)]
    cmd = ([sys.executable] if ranks == 1 else
           [os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port())]) + script
    out = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return {name: (json.load(open(out_dir / f"{name}.json")), np.load(out_dir / f"{name}.npy"))
            for name in ("lesson", "full")}


def close(a, b):
    """Within 1e-5 relative, or 1e-7 absolute where that is smaller."""
    return abs(a - b) <= max(1e-5 * abs(b), 1e-7)


@pytest.mark.parametrize("stage", [0, 2])
def test_one_update_is_the_full_trainers_on_one_rank_and_on_two(tmp_path, stage):
    """The lesson's update (grpo_step) on a fixed batch, where the TIS cap binds, against the full trainer's
    (grpo_update): on 1 rank, and on 2 ranks holding 3 + 1 groups, every logged figure within 1e-5 relative and
    every weight's move allclose; and the lesson's 2-rank update is its 1-rank one (the global batch's step)."""
    one, two = update_run(tmp_path, 1, stage), update_run(tmp_path, 2, stage)
    for run in (one, two):
        (mine, moved), (theirs, their_moved) = run["lesson"], run["full"]
        assert theirs["is_capped_frac"] > 0  # the cap binds on some tokens
        for key in lesson_step_figures():
            assert close(mine[key], theirs[key]), (mine["world"], key, mine[key], theirs[key])
        assert same_moves(moved, their_moved)
    (mine_one, moved_one), (mine_two, moved_two) = one["lesson"], two["lesson"]
    assert mine_one["world"] == 1 and mine_two["world"] == 2
    for key in lesson_step_figures():
        assert mine_two[key] == pytest.approx(mine_one[key], rel=1e-4, abs=1e-7), key
    assert same_moves(moved_two, moved_one)


def same_moves(moved, their_moved, lr=1e-4):
    """Every weight moved the same, within 1e-4 relative or a tenth of the step, and the whole move within 1e-4
    relative. Adam's first step moves a weight by lr * g / (|g| + 1e-8): about lr whatever the loss's scale (the
    figures above check that), and where g is near 1e-8 by the gradient's rounding noise (seen: 6% of lr)."""
    return (np.allclose(moved, their_moved, rtol=1e-4, atol=0.1 * lr)
            and np.linalg.norm(their_moved - moved) <= 1e-4 * np.linalg.norm(moved))


def lesson_step_figures():
    from tests.lesson_step import FIGURES
    return FIGURES
