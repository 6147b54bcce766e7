"""The trainers' research options end to end with real DeepSpeed and the tiny model: data files of
each kind (grpo_train.py: JSONL; the full trainer: Parquet and CSV too), a user's reward file, beta 0 without a
reference server, num_iterations, the GSM8K recipe."""
import csv
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from simple_grpo.task.problems import load_jsonl, make_prompt
from grpo_math import completion_mask
from simple_grpo.logprobs import sequence_logps
from simple_grpo.run.checkpoints import RUNS_ENV, runs_root
from simple_grpo.trainer.deepspeed_engine import make_engine
import grpo_train
from simple_grpo.train import Config
from simple_grpo.trainer.config import TrainerConfig, check_options
from simple_grpo.trainer.update import grpo_update

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "models", "tiny-math")
PROBLEMS = load_jsonl(os.path.join(ROOT, "data", "toy_math", "train.jsonl"))[:40]
REWARD_FILE = '''
from simple_grpo.task.rewards import reward_function

@reward_function("brevity")
def brevity(completion, answer):
    return 1.0 if len(completion) < 200 else 0.0
'''


def write_data(tmp_path, kind):
    """The same 40 problems as JSONL (GSM8K's field names), Parquet or CSV (other field names)."""
    path = tmp_path / f"problems.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
        return path, {}
    rows = [{"problem": p["question"], "solution": p["answer"], "id": i} for i, p in enumerate(PROBLEMS)]
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["problem", "solution", "id"])
            writer.writeheader()
            writer.writerows(rows)
    return path, {"question_field": "problem", "answer_field": "solution"}


SMALL_RUN = ["--beta", "0", "--ref_url", "http://127.0.0.1:9", "--steps", "2", "--batch_prompts", "2",
             "--num_generations", "4", "--max_new_tokens", "16", "--save_every", "100"]


def test_two_grpo_train_steps_from_a_jsonl_file(tmp_path, monkeypatch):
    """beta 0: no reference server anywhere (the URL points at a closed port)."""
    path, _ = write_data(tmp_path, "jsonl")
    monkeypatch.chdir(tmp_path)  # runs/ goes here: the default, without the test suite's $SIMPLE_GRPO_RUNS
    monkeypatch.delenv(RUNS_ENV, raising=False)
    grpo_train.main(grpo_train.parse_flags(["--model", TINY, "--dataset", str(path), "--run_name", "jsonl",
                                            *SMALL_RUN]))
    rows = [json.loads(line) for line in open(tmp_path / "runs" / "jsonl" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["kl"] in (0.0, None) and "accuracy" in r for r in rows)  # None: a step with no update
    assert os.path.exists(tmp_path / "runs" / "jsonl" / "step_2" / "model.safetensors")


@pytest.mark.parametrize("kind", ["parquet", "csv"])
def test_two_full_trainer_steps_from_each_kind_of_data_file(kind, tmp_path):
    """The other field names (--question_field, --answer_field), beta 0: no reference server anywhere. The
    Parquet run also adds a reward from a file, which then shows in the metrics, weighted into the reward."""
    path, fields = write_data(tmp_path, kind)
    extra = [arg for name, value in fields.items() for arg in (f"--{name}", value)]
    if kind == "parquet":
        (tmp_path / "my_rewards.py").write_text(REWARD_FILE)
        extra += ["--reward_file", str(tmp_path / "my_rewards.py"), "--reward_funcs", "correctness,format,brevity",
                  "--reward_weights", "1.0,0.5,0.25"]
    env = {k: v for k, v in os.environ.items() if k != RUNS_ENV}  # runs/ goes to tmp_path: the default
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-m", "simple_grpo.train", "--model", TINY, "--dataset", str(path), *extra,
                          *SMALL_RUN, "--run_name", kind], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "runs" / kind / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["kl"] == 0.0 and "reward_correctness" in r for r in rows)
    assert os.path.exists(tmp_path / "runs" / kind / "step_2" / "model.safetensors")
    if kind == "parquet":
        for r in rows:
            assert 0.0 <= r["reward_brevity"] <= 1.0
            want = r["reward_correctness"] + 0.5 * r["reward_format"] + 0.25 * r["reward_brevity"]
            assert r["reward_mean"] == pytest.approx(want, abs=1e-4)


def test_bad_options_fail_before_any_model_loads():
    for bad, name in (({"loss_type": "ppo"}, "loss_type"), ({"scale_rewards": "all"}, "scale_rewards"),
                      ({"kl_estimator": "k9"}, "kl_estimator"), ({"prompt_format": "xml"}, "prompt_format"),
                      ({"advantage_estimator": "ppo"}, "advantage_estimator")):
        with pytest.raises(SystemExit, match=name):
            check_options(Config(**bad))
    with pytest.raises(SystemExit, match="unknown reward"):
        check_options(Config(reward_funcs="correctness,nope", reward_weights="1,1"))
    for bad, name in (({"num_generations": 1}, "num_generations"), ({"temperature": 0.0}, "temperature")):
        with pytest.raises(SystemExit, match=name):
            check_options(Config(**bad))
    cfg = Config(loss_type="dr_grpo")
    check_options(cfg)
    assert cfg.scale_rewards == "none" and cfg.epsilon_high == cfg.epsilon
    cfg = Config(loss_type="dapo")
    check_options(cfg)
    assert cfg.scale_rewards == "group" and cfg.epsilon_high == 0.28


def test_the_default_lr_fits_the_model_and_a_given_lr_is_kept():
    """1e-4 for the tiny default model (`python grpo_train.py` trains it), 1e-6 (TRL's) for any other."""
    tiny, by_path, other, given = Config(), Config(model=TINY), Config(model="Qwen/Qwen2.5-0.5B"), Config(lr=3e-5)
    for cfg in (tiny, by_path, other, given):
        check_options(cfg)  # reads no model: the default comes from the name alone
    assert (tiny.lr, by_path.lr, other.lr, given.lr) == (1e-4, 1e-4, 1e-6, 3e-5)


def test_the_tiny_models_lr_is_its_own_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = Config(model=TINY, dataset=os.path.join(ROOT, "data", "toy_math", "train.jsonl"))
    check_options(cfg)
    assert cfg.lr == 1e-4


def test_each_derived_default_is_printed_with_why(capsys):
    check_options(Config(model="Qwen/Qwen2.5-0.5B", loss_type="dapo"))
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("  * ")] == [
        "  * epsilon_high 0.28: --loss_type dapo's upper clip",
        "  * scale_rewards group: each group's reward std divides its advantages",
        "  * lr 1e-06: the default for a model other than the tiny one",
        "  * ref_url http://127.0.0.1:59875: the default reference server (python ref_server.py), for "
        "--beta 0.04's KL term"]
    block = "\n".join(lines)
    assert "epsilon_high=0.28*" in block and "lr=1e-06*" in block and "epsilon=0.2," in block


def test_flags_the_user_set_are_not_printed_as_derived(capsys):
    check_options(Config(epsilon_high=0.3, scale_rewards="batch", lr=1e-5, ref_url="http://127.0.0.1:9"))
    out = capsys.readouterr().out
    assert "*" not in out.split("\n", 1)[1] and "epsilon_high=0.3," in out and "lr=1e-05," in out


def test_every_number_of_a_step_is_printed_in_one_block_at_start(capsys):
    """simple_grpo/train.py's block holds the trainers' numbers and its generation worker's, each with its value."""
    from simple_grpo.train import Config as VllmConfig
    from simple_grpo.trainer.config import STEP_NUMBERS
    cfg = VllmConfig(tis_cap=1.5, sync_every=2, max_policy_lag=3, beta=0.01)
    check_options(cfg)
    out = capsys.readouterr().out
    block = out[out.index("one step's numbers"):]
    for names in STEP_NUMBERS.values():
        for name in names:
            assert f" {name}=" in block, name
    for shown in ("tis_cap=1.5", "sync_every=2", "max_policy_lag=3", "beta=0.01", "num_generations=8"):
        assert shown in block
    check_options(TrainerConfig())  # a config without the generation worker's flags: no generation line
    assert "generation:" not in capsys.readouterr().out


def test_a_deepspeed_files_precision_stage_and_lr_print_as_derived(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
                                "optimizer": {"params": {"lr": 3e-5}}}))
    cfg = Config(deepspeed=str(path))
    check_options(cfg)
    out = capsys.readouterr().out
    assert (cfg.dtype, cfg.zero_stage, cfg.lr) == ("bfloat16", 2, 3e-5)
    for line in (f"  * lr 3e-05: from --deepspeed {path}", f"  * zero_stage 2: from --deepspeed {path}",
                 f"  * dtype bfloat16: from --deepspeed {path}"):
        assert line in out.splitlines()


def test_num_iterations_reuses_the_rollouts_and_the_second_ratio_is_the_first_steps_move():
    """Iteration 1 is on-policy (ratio 1); iteration 2 uses iteration 1's log-probs as old_logps,
    so its ratio is exp(logp after one step - logp before). The one-step policy comes from a
    second engine that takes num_iterations=1 on the same batch from the same start."""
    def engine_for(iterations):
        cfg = Config(model=TINY, beta=0.0, num_iterations=iterations, lr=1e-3, seed=0)
        check_options(cfg)
        engine, tokenizer = make_engine(cfg)
        return cfg, engine, tokenizer

    cfg1, one, tokenizer = engine_for(1)
    enc = tokenizer([make_prompt(tokenizer, PROBLEMS[0]["question"])], return_tensors="pt", add_special_tokens=False)
    torch.manual_seed(0)
    completions = torch.randint(10, 400, (4, 6))
    completions[:2, 4] = tokenizer.eos_token_id  # two end, two are cut off
    batch = {"prompt_ids": enc["input_ids"], "prompt_mask": enc["attention_mask"], "completion_ids": completions,
             "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5])}
    mask = completion_mask(completions, tokenizer.eos_token_id)
    batch["loss_mask"] = mask

    def logps(engine):
        with torch.no_grad():
            return sequence_logps(engine.module, batch["prompt_ids"], batch["prompt_mask"], completions, cfg1.temperature)

    before = logps(one)
    stats1, _ = grpo_update(one, dict(batch), cfg1)
    after_one_step = logps(one)
    assert stats1["ratio_mean"] == pytest.approx(1.0)
    cfg2, two, _ = engine_for(2)
    assert torch.allclose(logps(two), before)  # the same start
    stats2, _ = grpo_update(two, dict(batch), cfg2)
    hand = ((torch.exp(after_one_step - before) * mask).sum() / mask.sum()).item()
    assert stats2["ratio_mean"] == pytest.approx(hand, abs=1e-5) and abs(hand - 1) > 1e-4
    assert two.global_steps == 2 and one.global_steps == 1


@pytest.mark.parametrize("tis_cap", [0.0, 2.0])
def test_vllms_log_probs_are_pi_old_with_tis_cap_0_and_weight_the_tokens_otherwise(tis_cap):
    """grpo_update with the sampler's log-probs in the batch: --tis_cap 0 puts them in the ratio's denominator
    (ratio exp(logp - sampler's) from the first iteration); a cap keeps the trainer's own there (ratio 1) and
    weights each token by exp(trainer's - sampler's), capped."""
    from simple_grpo.train import Config as VllmConfig
    cfg = VllmConfig(model=TINY, beta=0.0, lr=1e-3, seed=0, tis_cap=tis_cap)
    check_options(cfg)
    engine, tokenizer = make_engine(cfg)
    enc = tokenizer([make_prompt(tokenizer, PROBLEMS[0]["question"])], return_tensors="pt", add_special_tokens=False)
    torch.manual_seed(0)
    completions = torch.randint(10, 400, (4, 6))
    with torch.no_grad():
        own = sequence_logps(engine.module, enc["input_ids"], enc["attention_mask"], completions, cfg.temperature)
    batch = {"prompt_ids": enc["input_ids"], "prompt_mask": enc["attention_mask"], "completion_ids": completions,
             "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5]), "sampler_logps": own - 0.05,
             "loss_mask": completion_mask(completions, tokenizer.eos_token_id)}
    stats, _ = grpo_update(engine, batch, cfg)
    if tis_cap == 0:
        assert stats["ratio_mean"] == pytest.approx(math.exp(0.05), abs=1e-4)
        assert "is_weight_mean" not in stats
    else:
        assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
        assert stats["is_weight_mean"] == pytest.approx(math.exp(0.05), abs=1e-4)


@pytest.mark.parametrize("zero_stage, loss_type", [(0, "grpo"), (2, "bnpo"), (0, "dr_grpo")])
def test_micro_batches_give_the_whole_batchs_step(zero_stage, loss_type):
    """Forward/backward one group at a time, then one step: the gradient that step uses is the
    whole batch's. (Compared before Adam: Adam's first step is ~lr * sign(g), so where g is ~0
    rounding alone flips a weight's move.)"""
    torch.manual_seed(0)
    Q, G = 3, 4
    batch = {"prompt_ids": torch.randint(3, 500, (Q, 7)), "prompt_mask": torch.ones(Q, 7, dtype=torch.long),
             "completion_ids": torch.randint(3, 500, (Q * G, 5)), "advantages": torch.randn(Q * G),
             }
    batch["completion_ids"][::3, 2] = 2  # some completions end early (EOS is id 2 in the tiny tokenizer)
    batch["loss_mask"] = completion_mask(batch["completion_ids"], 2)
    from transformers import AutoModelForCausalLM
    with torch.no_grad():  # reference log-probs near the policy's, as a real reference model's are
        model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
        batch["ref_logps"] = sequence_logps(model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                            0.7) + 0.1 * torch.randn(Q * G, 5)
    results = []
    for groups in (0, 1):
        cfg = Config(model=TINY, zero_stage=zero_stage, loss_type=loss_type, micro_batch_groups=groups)
        check_options(cfg)
        engine, tokenizer = make_engine(cfg)
        assert tokenizer.eos_token_id == 2
        params = list(engine.module.parameters())
        grads = [torch.zeros_like(p) for p in params]
        def adder(acc):
            def add(g):
                acc.add_(g.detach())  # returns None: the gradient itself is left as it is
            return add

        hooks = [p.register_hook(adder(acc)) for p, acc in zip(params, grads)]
        stats, _ = grpo_update(engine, dict(batch), cfg)
        for h in hooks:
            h.remove()
        results.append((torch.cat([g.flatten() for g in grads]), stats))
    (whole, whole_stats), (parts, parts_stats) = results
    assert whole.abs().max() > 1e-3  # a real gradient
    assert torch.allclose(whole, parts, atol=1e-6), (whole - parts).abs().max()
    assert parts_stats["loss"] == pytest.approx(whole_stats["loss"], abs=1e-6)
    assert parts_stats["kl"] == pytest.approx(whole_stats["kl"], abs=1e-6)
    assert parts_stats["skipped_updates"] == whole_stats["skipped_updates"] == 0


@pytest.mark.slow  # a whole run (~40 s); RAFT's advantages and loss are checked fast in tests/test_loss_variants.py
def test_raft_trains_on_the_correct_completions_and_refuses_the_regrouping_server():
    from simple_grpo.train import Config as VllmConfig
    with pytest.raises(SystemExit, match="--advantage_estimator raft with --regroup"):
        check_options(VllmConfig(advantage_estimator="raft", regroup=True))
    out = subprocess.run([sys.executable, "-m", "simple_grpo.train", "--advantage_estimator", "raft", "--beta", "0",
                          "--lr", "1e-4", "--steps", "2", "--batch_prompts", "4", "--num_generations", "4",
                          "--max_new_tokens", "32", "--threads", "1", "--run_name", "test_raft", "--overwrite"],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(runs_root(), "test_raft", "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2]
    # RAFT's update raises the log-probs of kept completions only: every advantage is 1 or 0, none negative
    trained = [r for r in rows if r["grad_norm"]]
    assert trained and all(r["loss"] < 0 for r in trained)


@pytest.mark.slow  # a whole run (~25 s); tests/test_run_outputs.py runs it, beta 0, a closed --ref_url, fast
def test_the_full_trainer_with_beta_zero_needs_no_reference_server():
    out = subprocess.run([sys.executable, "-m", "simple_grpo.train", "--beta", "0", "--ref_url", "http://127.0.0.1:9",
                          "--steps", "2", "--batch_prompts", "2", "--num_generations", "4", "--max_new_tokens", "16",
                          "--run_name", "test_beta0", "--loss_type", "dr_grpo"],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(runs_root(), "test_beta0", "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2] and all(r["kl"] == 0.0 for r in rows)


@pytest.mark.slow
def test_the_gsm8k_recipe_runs_two_steps_on_cpu_with_the_tiny_model():
    """recipes/gsm8k.sh, the README's GPU recipe, with the tiny model and toy data swapped in."""
    env = {**os.environ, "MODEL": "models/tiny-math", "DATASET": "data/toy_math/train.jsonl", "DATASET_CONFIG": "",
           "EVAL_DATASET": "data/toy_math/test.jsonl", "REF_DEVICE": "cpu", "STEPS": "2", "RUN": "test_recipe",
           "DTYPE": "float32",
           "BATCH_PROMPTS": "2", "NUM_GENERATIONS": "4", "MAX_NEW_TOKENS": "32", "MAX_MODEL_LEN": "512",
           "PORT": "59891", "PY": sys.executable, "DEEPSPEED": os.path.join(os.path.dirname(sys.executable), "deepspeed")}
    out = subprocess.run(["bash", "recipes/gsm8k.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(runs_root(), "test_recipe", "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["n"] == 500 and 0.0 <= result["accuracy"] <= 1.0
