"""make demo-real, short: SmolLM2-135M-Instruct through every stage of tools/demo_real.py (slow; the start's
flags, fast).

    python -m pytest -q -m slow tests/test_demo_real.py

A short supervised start (8 steps, dev scored at steps 4 and 8, the best kept), probe, base and before
evaluations, 2 GRPO steps with LoRA, the supervised control for GRPO's minutes, the after and control
evaluations and both paired gains, on 16 test problems. The figures are the demo's own; whether GRPO
helps is the full demo's question (README, "A real model on your CPU"), not this test's.
"""
import json
import os
import subprocess
import sys

import pytest

from tests.test_smollm2 import smollm2  # noqa: F401 - the converted model fixture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHOLE = pytest.mark.timeout(2400)  # the warm start alone is ~6 minutes when not cached


def test_another_start_seed_is_another_start_cached_apart():
    from tools.demo_real import start_flags, start_tag
    from simple_grpo.run.smollm2_recipe import FEW_START_FLAGS

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
                           "grpo_minutes", "minutes"}
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
    run_dir = os.path.join(ROOT, "runs", run)
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
                           "raft_minutes", "minutes"}
    for name in models:
        assert report[name]["n"] == 16 and 0 <= report[name]["accuracy"] <= 1, report[name]
    for other in ("start", "raft", "control"):
        assert report[f"gain_vs_{other}"]["accuracy"] == pytest.approx(
            report["grpo"]["accuracy"] - report[other]["accuracy"], abs=1e-3)
    run_dir = os.path.join(ROOT, "runs", run)
    with open(os.path.join(run_dir, "report.json")) as f:
        assert json.load(f) == report  # the printed JSON line, kept for tools/seed_table.py
    with open(os.path.join(run_dir, "answers_only.jsonl")) as f:
        first = json.loads(f.readline())
    assert first["answer"].startswith("#### ") and "<<" not in first["answer"]  # no worked solution in it
    for name in (f"{run}_grpo", f"{run}_raft"):
        rows = [json.loads(line) for line in open(os.path.join(ROOT, "runs", name, "metrics.jsonl"))]
        assert [r["step"] for r in rows] == [1, 2]
