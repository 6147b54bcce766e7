"""grpo_train.py end to end on the tiny default, with a live reference server (real DeepSpeed); what it leaves to the
full trainer is refused by name. Its copies of the full trainer's code: tests/test_grpo_train_copies.py."""
import json
import os
import subprocess
import sys

import pytest
import torch

from simple_grpo.run.checkpoints import runs_root
from tests.test_ref_server import server  # noqa: F401 - the live server fixture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "models", "tiny-math")


def test_importing_grpo_train_starts_nothing_and_its_update_takes_the_loss_from_grpo_math():
    out = subprocess.run([sys.executable, "-c", "import grpo_train, grpo_math, simple_grpo.trainer.update as update; "
                          "assert grpo_train.grpo_loss is update.grpo_loss is grpo_math.grpo_loss; "
                          "assert grpo_train.completion_logps is grpo_math.completion_logps; print('ok')"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("flags, env, named", [(["--micro_batch_groups", "1"], {}, "--micro_batch_groups"),
                                              (["--loss_impl", "triton"], {}, "--loss_impl triton"),
                                              ([], {"WORLD_SIZE": "2"}, "2 ranks")])
def test_what_only_the_fast_trainer_has_stops_naming_it(flags, env, named):
    out = subprocess.run([sys.executable, "grpo_train.py", "--steps", "1", "--run_name", "test_fast_only", *flags],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert out.returncode != 0 and named in out.stderr, out.stderr[-2000:]
    assert "python -m simple_grpo.train" in out.stderr, out.stderr[-2000:]


def test_the_sampler_draws_from_the_temperature_softmax_whatever_the_models_generation_config_says():
    """hf_sampler.generate samples from softmax(logits / T), the distribution grpo_math.completion_logps
    computes: a repetition penalty and a top-k in the model's generation_config change no token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from simple_grpo.generation.hf_sampler import generate
    from simple_grpo.task.problems import TaskConfig, load_data, make_prompt, stop_token_ids
    cfg = TaskConfig(model=TINY, num_generations=4, max_new_tokens=24)
    tokenizer, model = AutoTokenizer.from_pretrained(TINY), AutoModelForCausalLM.from_pretrained(TINY)
    prompts = [make_prompt(tokenizer, p["question"], cfg.prompt_format, cfg.system_prompt) for p in load_data(cfg)[:2]]
    sampled = []
    for penalty, top_k in ((None, None), (3.0, 5)):  # the tiny model's own config sets neither
        model.generation_config.repetition_penalty, model.generation_config.top_k = penalty, top_k
        torch.manual_seed(0)
        sampled.append(generate(model, tokenizer, prompts, cfg, stop_token_ids(tokenizer, cfg.prompt_format))[2])
    assert torch.equal(*sampled)
    assert model.generation_config.repetition_penalty == 3.0  # the model's own config is left as it was


def test_without_a_ref_server_the_trainer_says_so():
    out = subprocess.run([sys.executable, "grpo_train.py", "--ref_url", "http://127.0.0.1:9", "--steps", "1",
                          "--peer_timeout", "3",  # the default 30 s of retries would only make the test wait
                          "--run_name", "test_no_server"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0 and "ref server at http://127.0.0.1:9" in out.stderr


@pytest.mark.slow
def test_three_steps_write_metrics_and_checkpoints(server, tmp_path):  # noqa: F811
    run = "test_e2e"
    os.makedirs(os.path.join(runs_root(), run, "step_99"), exist_ok=True)  # an earlier run's checkpoint...
    out = subprocess.run([sys.executable, "grpo_train.py", "--ref_url", server, "--steps", "3", "--save_every", "2",
                          "--run_name", run, "--batch_prompts", "4",
                          "--overwrite"],  # ...which only --overwrite replaces (tests/test_run_dir.py: refused without)
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = os.path.join(runs_root(), run)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("reward_mean", "accuracy", "format_rate", "kl", "clip_fraction", "ratio_mean", "grad_norm",
                "completion_len", "zero_var_frac", "tokens_per_s"):
        assert all(key in r for r in rows), key
    trained = [r for r in rows if r["zero_var_frac"] < 1]
    assert trained and all(r["grad_norm"] > 0 and r["kl"] >= 0 for r in trained)  # some group had signal
    assert sorted(d for d in os.listdir(run_dir) if d.startswith("step_")) == ["step_2", "step_3"]
    for step in (2, 3):
        assert os.path.exists(os.path.join(run_dir, f"step_{step}", "model.safetensors"))


@pytest.mark.slow
def test_the_full_trainers_second_iteration_moves_the_ratio_and_its_run_draws_curves(server):  # noqa: F811
    """--num_iterations is the full trainer's: its second iteration on the same rollouts sees the policy the first
    one moved (ratio != 1); and its run ends with curves.png."""
    run = "test_e2e_iterations"
    out = subprocess.run([sys.executable, "-m", "simple_grpo.train", "--ref_url", server, "--steps", "3",
                          "--save_every", "2", "--run_name", run, "--batch_prompts", "4", "--num_iterations", "2",
                          "--overwrite"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = os.path.join(runs_root(), run)
    # the run doctor's warnings are lines of their own (at the default lr, 1e-4 for the tiny model, the second
    # iteration of step 1 can see a KL above --doctor_kl_max after the first update)
    rows = [r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if "warning" not in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert any(r["ratio_mean"] != 1.0 for r in rows)
    assert sorted(d for d in os.listdir(run_dir) if d.startswith("step_")) == ["step_2", "step_3"]
    assert os.path.getsize(os.path.join(run_dir, "curves.png")) > 1000
