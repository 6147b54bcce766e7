"""tools/warm_start.py on the tiny model: it trains and saves a model that loads, caches by its key (a hash of its
flags, code and data), and refuses bad flags by name. (SmolLM2's own warm start runs in tests/test_demo_real.py,
slow.)"""
import json
import os
import random
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from simple_grpo.task.problems import load_jsonl, make_prompt
from simple_grpo.task.supervised import make_batch, sft_target, solution_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT_PROMPT = "Think in <think> </think>, answer in <answer> </answer>."


def warm_start(out, *args):
    return subprocess.run([sys.executable, "tools/warm_start.py", "--model", "models/tiny-math", "--out", str(out),
                           "--steps", "2", "--batch_size", "2", "--system_prompt", SHORT_PROMPT, *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_targets_are_the_solution_in_format_or_another_style():
    problem = load_jsonl(os.path.join(ROOT, "data/toy_math/train.jsonl"))[0]
    steps = solution_steps(problem["answer"])
    assert steps == "39+11=50\n50/5=10"
    rng = random.Random(0)
    styles = {sft_target(problem, rng, 0.5) for _ in range(200)}
    assert f"<think>{steps}</think><answer>10</answer>" in styles
    assert styles == {f"<think>{steps}</think><answer>10</answer>", f"<think>{steps}</think>The answer is 10.",
                      "<answer>10</answer>", "The answer is 10."}
    assert {sft_target(problem, rng, 1.0) for _ in range(20)} == {f"<think>{steps}</think><answer>10</answer>"}


def test_the_batch_trains_on_the_target_and_the_turn_end_only():
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "models/tiny-math"))
    prompt = make_prompt(tokenizer, "Tom has 3 pens. How many?", "chat", SHORT_PROMPT)
    assert SHORT_PROMPT in prompt
    ids, labels = make_batch(tokenizer, [prompt], ["<answer>3</answer>"], tokenizer.eos_token)
    trained = labels[0][labels[0] != -100].tolist()
    assert tokenizer.decode(trained) == "<answer>3</answer>" + tokenizer.eos_token
    assert ids[0, -len(trained):].tolist() == trained


def test_it_saves_a_model_then_reuses_it_and_refuses_other_flags(few_problems_start):
    data, out = few_problems_start
    with open(out / "warm_start.json") as f:
        record = json.load(f)
    assert [h["step"] for h in record["history"]] == [1, 2] and record["recipe"]["system_prompt"] == SHORT_PROMPT
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(out)  # a whole model directory
    again = warm_start(out, "--train", data)
    assert again.returncode == 0 and "already made with these flags" in again.stdout
    other = warm_start(out, "--train", data, "--lr", "1e-4")
    assert other.returncode != 0 and "made with other flags" in other.stderr


@pytest.mark.parametrize("args, message", [(["--in_format_share", "0"], "--in_format_share"),
                                           (["--model", "no/such/dir"], "give a model directory")])
def test_bad_flags_are_named(tmp_path, args, message):
    result = warm_start(tmp_path / "warm", *args)
    assert result.returncode != 0 and message in result.stderr


def test_it_keeps_the_checkpoint_with_the_best_dev_accuracy(tmp_path):
    out = tmp_path / "warm"
    result = warm_start(out, "--steps", "6", "--lr", "3e-3", "--eval_every", "2", "--dev_n", "16",
                        "--dev_max_new_tokens", "48")
    assert result.returncode == 0, result.stderr[-2000:]
    with open(out / "warm_start.json") as f:
        record = json.load(f)
    curve = record["dev_curve"]
    assert [p["step"] for p in curve] == [2, 4, 6] and (out / "dev_curve.png").is_file()
    best = max(curve, key=lambda p: p["accuracy"])  # the first of the best, as the tool keeps it
    assert record["best"] == best
    # the model in --out is that checkpoint: scored again, it gets the recorded dev accuracy
    from transformers import AutoModelForCausalLM
    from tools.warm_start import WarmStartConfig, dev_accuracy
    cfg = WarmStartConfig(model="models/tiny-math", out=str(out), system_prompt=SHORT_PROMPT, dev_n=16,
                          dev_max_new_tokens=48)
    dev = load_jsonl(os.path.join(ROOT, cfg.dev))[:16]
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert dev_accuracy(AutoModelForCausalLM.from_pretrained(out), tokenizer, dev, cfg) == \
        {k: best[k] for k in ("accuracy", "format_rate", "mean_tokens")}


def test_patience_stops_at_the_plateau(tmp_path):
    # at lr 1e-12 the model does not change, so no evaluation after the first is a new best
    result = warm_start(tmp_path / "warm", "--steps", "20", "--lr", "1e-12", "--eval_every", "2", "--patience", "2",
                        "--dev_n", "8", "--dev_max_new_tokens", "32")
    assert result.returncode == 0, result.stderr[-2000:]
    with open(tmp_path / "warm" / "warm_start.json") as f:
        record = json.load(f)
    assert [p["step"] for p in record["dev_curve"]] == [2, 4, 6] and record["best"]["step"] == 2
    assert len(record["history"]) == 6 and "the plateau" in result.stdout


def test_max_minutes_ends_it_on_a_time_budget(tmp_path):
    result = warm_start(tmp_path / "warm", "--steps", "50", "--max_minutes", "0.0001")
    assert result.returncode == 0, result.stderr[-2000:]
    with open(tmp_path / "warm" / "warm_start.json") as f:
        assert len(json.load(f)["history"]) == 1
    assert "minutes of training reached at step 1" in result.stdout


def test_patience_without_evaluations_is_refused(tmp_path):
    result = warm_start(tmp_path / "warm", "--patience", "2")
    assert result.returncode != 0 and "give --eval_every too" in result.stderr


@pytest.mark.slow  # two warm starts (~15 s); the fast suite is near its 20-minute budget
def test_a_linear_schedule_ends_at_zero_and_train_n_takes_the_first_problems(tmp_path):
    result = warm_start(tmp_path / "warm", "--steps", "10", "--lr", "1e-4", "--lr_schedule", "linear",
                        "--train_n", "4")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "of 4 problems of data/toy_math/train.jsonl" in result.stdout
    with open(tmp_path / "warm" / "warm_start.json") as f:
        record = json.load(f)
    lrs = [h["lr"] for h in record["history"]]
    assert lrs[:5] == pytest.approx([1e-4 * (s + 1) / 5 * (1 - s / 10) for s in range(5)])  # warm-up x decay
    assert lrs[4:] == sorted(lrs[4:], reverse=True) and lrs[-1] == pytest.approx(1e-5)  # falls to 0 at step 10
    assert record["recipe"]["train_n"] == 4 and record["recipe"]["lr_schedule"] == "linear"
    too_few = warm_start(tmp_path / "few", "--train_n", "1")
    assert too_few.returncode != 0 and "1 problems, fewer than --batch_size 2" in too_few.stderr


# ---------------------------------------------------------------- the cache key: flags, code and data
def print_key(*args):
    """What `tools/warm_start.py --model models/tiny-math ARGS --print_key` prints (the CLI itself: cli_key),
    computed in this process, from the repository as the CLI runs there."""
    from simple_grpo.flags import parse_flags
    from tools.warm_start import WarmStartConfig, start_key, start_recipe, start_sources
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        cfg = parse_flags(WarmStartConfig, args=["--model", "models/tiny-math", *map(str, args)])
        return start_key(start_recipe(cfg), start_sources(cfg))
    finally:
        os.chdir(cwd)


def cli_key(*args):
    out = subprocess.run([sys.executable, "tools/warm_start.py", "--model", "models/tiny-math", *map(str, args),
                          "--print_key"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def few_problems(path, first_answer=None):
    """The first 16 training problems in a file of their own; first_answer rewrites the first one's solution."""
    problems = load_jsonl(os.path.join(ROOT, "data/toy_math/train.jsonl"))[:16]
    if first_answer is not None:
        problems[0] = dict(problems[0], answer=first_answer)
    with open(path, "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in problems)
    return path


@pytest.fixture(scope="module")
def few_problems_start(tmp_path_factory):
    """One warm start (2 steps) from the first 16 training problems, a file of their own: (that file, the start's
    directory), for the tests that read a made start (one training for the three of them)."""
    where = tmp_path_factory.mktemp("few_problems_start")
    data, out = few_problems(where / "train.jsonl"), where / "warm"
    made = warm_start(out, "--train", data)
    assert made.returncode == 0, made.stderr[-2000:]
    return data, out


def test_the_cache_key_changes_with_the_training_data(tmp_path):
    data = few_problems(tmp_path / "train.jsonl")
    key = print_key("--train", data)
    assert len(key) == 12 and cli_key("--train", data) == key  # the same flags, code and data: the same key
    few_problems(data, first_answer="She has: 3+4=<<3+4=7>>7\n#### 7")  # the same path, other contents
    assert print_key("--train", data) != key


def test_the_cache_key_changes_with_the_flags_and_with_the_dev_data_only_when_it_is_read(tmp_path):
    dev = few_problems(tmp_path / "dev.jsonl")
    assert print_key("--lr", "1e-4") != print_key("--lr", "2e-4")
    scored = print_key("--dev", dev, "--eval_every", "2")
    few_problems(dev, first_answer="She has: 3+4=<<3+4=7>>7\n#### 7")
    assert print_key("--dev", dev, "--eval_every", "2") != scored  # dev accuracy picks the kept checkpoint
    assert print_key("--dev", dev) == print_key("--dev", tmp_path / "dev.jsonl")  # without --eval_every it is not read


def test_the_record_holds_the_key_and_the_hash_of_each_file_the_start_depends_on(few_problems_start):
    from tools.warm_start import START_CODE, file_sha256
    data, out = few_problems_start
    with open(out / "warm_start.json") as f:
        record = json.load(f)
    assert record["key"] == print_key("--steps", "2", "--batch_size", "2", "--system_prompt", SHORT_PROMPT,
                                      "--train", data)
    assert set(record["sources"]) == {*START_CODE, str(data)}
    assert all(record["sources"][path] == file_sha256(os.path.join(ROOT, path)) for path in START_CODE)
    assert record["sources"][str(data)] == file_sha256(data)


def test_a_start_made_from_other_data_is_refused_in_its_directory_naming_the_file(few_problems_start):
    data, out = few_problems_start
    few_problems(data, first_answer="She has: 3+4=<<3+4=7>>7\n#### 7")
    try:
        again = warm_start(out, "--train", data)
    finally:
        few_problems(data)  # the file the start was made from again, for the other tests of the start
    assert again.returncode != 0 and "made with other flags, code or data" in again.stderr
    assert f"{data} (another version there)" in again.stderr


def test_the_demo_trains_a_start_from_other_data_in_a_directory_of_its_own(tmp_path):
    """tools/launch.py names a start's directory by its key: other data, another directory, so the
    demo trains that start anew instead of reusing the one made from the old data."""
    from tools.launch import warm_start_dir
    data = few_problems(tmp_path / "train.jsonl")
    flags = ["--train", str(data), "--steps", "2"]
    first = warm_start_dir("models/tiny-math", flags, dict(os.environ))
    assert first == "models/tiny-math-warm-" + print_key(*flags)
    assert warm_start_dir("models/tiny-math", flags, dict(os.environ)) == first
    few_problems(data, first_answer="She has: 3+4=<<3+4=7>>7\n#### 7")
    assert warm_start_dir("models/tiny-math", flags, dict(os.environ)) != first
