"""make demo-real, short: SmolLM2-135M-Instruct through every stage of tools/demo_real.py (slow; the start's
flags, fast).

    python -m pytest -q -m slow tests/test_demo_real.py

A short supervised start (8 steps, dev scored at steps 4 and 8, the best kept), probe, base and before
evaluations, 2 GRPO steps with LoRA, the supervised control for 3 steps (control_steps(2)), the after and control
evaluations and both paired gains, on 16 test problems. The figures are the demo's own; whether GRPO helps is
the full demo's question (README, "A real model on your CPU"), not this test's. The fast tests check, without
training SmolLM2, what the demo fixes before it trains (the control's steps, the start it accepts), which
checkpoint it evaluates, what it caches and what report.json records.
"""
import json
import os
import re
import subprocess
import sys

import pytest

from simple_grpo.run.checkpoints import runs_root
from tests.test_smollm2 import smollm2  # noqa: F401 - the converted model fixture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHOLE = pytest.mark.timeout(2400)  # the warm start alone is ~6 minutes when not cached


def test_another_start_seed_is_another_start_cached_apart():
    from tools.demo_real import start_flags, start_tag
    from tools.smollm2_recipe import FEW_START_FLAGS

    class Args:
        warm_start_flags, start_seed = None, 0
    assert start_flags(Args, FEW_START_FLAGS) == FEW_START_FLAGS and start_tag(Args) == ""  # the cache key kept
    Args.start_seed = 1
    assert start_flags(Args, FEW_START_FLAGS) == [*FEW_START_FLAGS, "--seed", "1"]  # another cache directory
    assert start_tag(Args) == "_start1"
    Args.warm_start_flags = "--steps 8"
    assert start_flags(Args, FEW_START_FLAGS) == ["--steps", "8", "--seed", "1"]


@pytest.mark.slow
@WHOLE
def test_demo_real_runs_end_to_end_in_short(smollm2):  # noqa: F811
    run = "test_demo_real"
    short_start = "--batch_size 8 --lr 1e-4 --in_format_share 1.0 --steps 8 --eval_every 4 --dev_n 16"
    out = subprocess.run([sys.executable, "tools/demo_real.py", "--steps", "2", "--n", "16", "--run_name", run,
                          "--warm_start_flags", short_start],
                         cwd=ROOT, capture_output=True, text=True, timeout=2300,
                         env=dict(os.environ, SIMPLE_GRPO_SMOLLM2=smollm2))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(report) == {"base", "before", "control", "after", "gain_vs_before", "gain_vs_control",
                           "grpo_minutes", "minutes", "steps", "control_steps_derivation", "commit", "start", "flags"}
    assert report["steps"] == {"grpo": 2, "control": 3}
    assert set(report["flags"]) == {"start", "grpo", "control", "evaluation"}
    for name in ("base", "before", "control", "after"):
        assert report[name]["n"] == 16 and 0 <= report[name]["accuracy"] <= 1, report[name]
    assert report["before"]["format_rate"] > report["base"]["format_rate"]  # the warm start taught some format
    for key, other in (("gain_vs_before", "before"), ("gain_vs_control", "control")):
        low, high = report[key]["ci95"]
        assert low <= report[key]["accuracy"] <= high
        assert report[key]["accuracy"] == pytest.approx(report["after"]["accuracy"] - report[other]["accuracy"],
                                                        abs=1e-3)
        # the strict integer re-score beside it, paired the same way
        assert report[key]["accuracy_strict"] == pytest.approx(
            report["after"]["accuracy_strict"] - report[other]["accuracy_strict"], abs=1e-3)
    assert 0 < report["grpo_minutes"] < report["minutes"]
    assert "GRPO's gain over the control" in out.stdout
    assert "verdict:" in out.stdout  # the probe spoke
    run_dir = os.path.join(runs_root(), run)
    for name in ("config.json", "metrics.jsonl", "report.html", "eval_base.jsonl", "eval_after.jsonl",
                 "eval_control.jsonl", "control/warm_start.json", "step_2/adapter_model.safetensors"):
        assert os.path.isfile(os.path.join(run_dir, name)), name


@pytest.mark.slow
@WHOLE
def test_the_answers_setting_runs_end_to_end_in_short(smollm2):  # noqa: F811
    """--setting answers: a short start on the few solutions, 2 steps each of GRPO and RAFT on the answers-only
    problems, the control, five evaluations and GRPO's three paired gains, on 16 test problems."""
    run = "test_demo_answers"
    short_start = "--batch_size 8 --lr 1e-4 --in_format_share 1.0 --train_n 300 --lr_schedule linear --steps 8 " \
                  "--eval_every 4 --dev_n 16"
    out = subprocess.run([sys.executable, "tools/demo_real.py", "--setting", "answers", "--steps", "2", "--n", "16",
                          "--run_name", run, "--warm_start_flags", short_start],
                         cwd=ROOT, capture_output=True, text=True, timeout=2300,
                         env=dict(os.environ, SIMPLE_GRPO_SMOLLM2=smollm2))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    models = ("base", "start", "control", "raft", "grpo")
    assert set(report) == {*models, "gain_vs_start", "gain_vs_raft", "gain_vs_control", "grpo_minutes",
                           "raft_minutes", "minutes", "steps", "control_steps_derivation", "commit", "start_made",
                           "flags"}
    assert report["steps"] == {"grpo": 2, "raft": 2, "control": 3}
    assert set(report["flags"]) == {"start", "grpo", "raft", "control", "evaluation"}
    assert report["start_made"]["recipe"]["train_n"] == 300
    for name in models:
        assert report[name]["n"] == 16 and 0 <= report[name]["accuracy"] <= 1, report[name]
    for other in ("start", "raft", "control"):
        assert report[f"gain_vs_{other}"]["accuracy"] == pytest.approx(
            report["grpo"]["accuracy"] - report[other]["accuracy"], abs=1e-3)
    run_dir = os.path.join(runs_root(), run)
    with open(os.path.join(run_dir, "report.json")) as f:
        assert json.load(f) == report  # the printed JSON line, kept for tools/seed_table.py
    with open(os.path.join(run_dir, "answers_only.jsonl")) as f:
        first = json.loads(f.readline())
    assert first["answer"].startswith("#### ") and "<<" not in first["answer"]  # no worked solution in it
    for name in (f"{run}_grpo", f"{run}_raft"):
        rows = [json.loads(line) for line in open(os.path.join(runs_root(), name, "metrics.jsonl"))]
        assert [r["step"] for r in rows] == [1, 2]


# ---------------------------------------------------------------- what the demo fixes before it trains, and records
def test_the_controls_steps_are_fixed_from_grpos_steps_not_timed():
    from tools.demo_real import control_steps, control_steps_derivation
    from tools.smollm2_recipe import CONTROL_STEPS_PER_GRPO_STEP, STEPS
    assert CONTROL_STEPS_PER_GRPO_STEP == 1.5 and control_steps(STEPS) == 60  # 60 supervised steps for GRPO's 40
    assert control_steps(80) == 120 and control_steps(0) == 1
    assert control_steps_derivation(40) == ("round(40 GRPO steps x 1.5 supervised steps a GRPO step costs "
                                            "(smollm2_recipe.CONTROL_STEPS_PER_GRPO_STEP)) = 60")


def tiny_warm_start(out, *args):
    result = subprocess.run([sys.executable, "tools/warm_start.py", "--model", "models/tiny-math", "--out", str(out),
                             "--batch_size", "2", *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_report_records_the_steps_each_arm_trained_the_commit_the_start_and_every_flag(tmp_path):
    """provenance() on a real (tiny) start and a control trained from it for control_steps(2) steps."""
    from tools.launch import git_commit
    from tools.demo_real import control_steps, provenance
    start, control = tmp_path / "start", tmp_path / "control"
    tiny_warm_start(start, "--steps", "2")
    control_argv = ["tools/warm_start.py", "--model", str(start), "--out", str(control), "--steps",
                    str(control_steps(2))]
    tiny_warm_start(control, "--steps", control_steps(2))
    commands = {"start": ["--steps", "2"], "grpo": ["-m", "simple_grpo.train", "--steps", "2"], "control": control_argv}
    record = provenance(str(start), str(control), commands, {"grpo": 2, "raft": 2})
    assert record["steps"] == {"grpo": 2, "raft": 2, "control": 3}  # the control's as its warm_start.json counts
    assert record["control_steps_derivation"].startswith("round(2 GRPO steps x 1.5") and \
        record["control_steps_derivation"].endswith("= 3")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert record["commit"] == head and len(head) == 40
    with open(start / "warm_start.json") as f:
        made = json.load(f)
    assert record["start_made"] == {"dir": str(start), "key": made["key"], "recipe": made["recipe"]}
    assert record["start_made"]["recipe"]["steps"] == 2 and record["start_made"]["recipe"]["batch_size"] == 2
    assert record["flags"] == commands
    assert git_commit(tmp_path) is None  # outside a git checkout


def test_the_answers_setting_refuses_a_start_trained_on_answers_only_problems():
    out = subprocess.run([sys.executable, "tools/demo_real.py", "--setting", "answers", "--warm_start_flags",
                          "--batch_size 8 --steps 8", "--run_name", "test_refused_start"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "(no --train_n) train it on the worked solutions of all training problems" in out.stderr
    assert "add --train_n 300 to --warm_start_flags" in out.stderr
    assert not os.path.exists(os.path.join(runs_root(), "test_refused_start"))  # refused before anything ran


@pytest.mark.parametrize("flags, message", [
    (["--train_n", "500"], "(--train_n 500) train it on the worked solutions of 500 training problems"),
    (["--train_n=0"], "(no --train_n)"),
    (["--train_n", "300", "--train", "data/other.jsonl"], "the start's flags give --train data/other.jsonl")])
def test_a_start_beyond_the_few_solutions_is_refused_by_name(flags, message):
    from tools.demo_real import check_few_solutions_start
    with pytest.raises(SystemExit, match=re.escape(message)):
        check_few_solutions_start(flags)


def test_the_recipes_start_and_fewer_solutions_are_accepted():
    from tools.demo_real import check_few_solutions_start
    from tools.smollm2_recipe import FEW_START_FLAGS
    check_few_solutions_start(FEW_START_FLAGS)
    check_few_solutions_start(["--train_n=100", "--train", "data/toy_math/train.jsonl"])


def test_the_evaluated_checkpoint_is_the_last_one_the_trainer_saved(tmp_path):
    """--steps after -- changes the steps trained: the checkpoint evaluated follows them."""
    from tools.launch import trained_checkpoint
    for d in ("step_2", "step_10", "step_12.tmp", "control"):  # step_12.tmp: a save a kill cut short
        (tmp_path / d).mkdir()
    assert trained_checkpoint(str(tmp_path)) == (str(tmp_path / "step_10"), 10)
    with pytest.raises(SystemExit, match="holds no checkpoint step_N/"):
        trained_checkpoint(str(tmp_path / "control"))


def test_base_and_start_are_evaluated_once_per_start_and_cached_beside_it(tmp_path, capsys):
    from tools.launch import cached_evaluate
    start, env = tmp_path / "start", dict(os.environ)
    start.mkdir()
    eval_args = ["--backend", "hf", "--n", "4"]
    first = cached_evaluate("base", "models/tiny-math", str(start), env, eval_args, str(tmp_path / "first.jsonl"))
    cached = list((start / "evals").iterdir())
    assert sorted(p.suffix for p in cached) == [".json", ".jsonl"] and first["n"] == 4
    again = cached_evaluate("base", "models/tiny-math", str(start), env, eval_args, str(tmp_path / "again.jsonl"))
    assert again == first and "the evaluation cached in" in capsys.readouterr().out
    assert (tmp_path / "again.jsonl").read_text() == (tmp_path / "first.jsonl").read_text()
    assert sorted((start / "evals").iterdir()) == sorted(cached)  # nothing evaluated again
    other = cached_evaluate("base", "models/tiny-math", str(start), env, ["--backend", "hf", "--n", "2"],
                            str(tmp_path / "other.jsonl"))
    assert other["n"] == 2 and len(list((start / "evals").iterdir())) == 4  # other flags: another evaluation
