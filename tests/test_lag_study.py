"""tools/lag_study.py, issue 74's pre-registered study: its runs' commands, its budget rule, its registered
difference and wording, checked on made-up details files before any of the study's results is read."""
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from simple_grpo.flags import parse_flags
from simple_grpo.run.checkpoints import runs_root
from tools import lag_study
from tools.launch import ROOT, TINY_WORLD_FLAGS, TRAINER_ARGS


def test_each_run_is_the_demos_full_trainer_with_the_lag_the_cap_and_a_checkpoint_every_25_steps():
    from simple_grpo.train import Config
    args = SimpleNamespace(name="lag_study", steps_lag1=650, steps_lagk=700, train_args=[])
    for lag in lag_study.LAGS:
        for cap in lag_study.CAPS:
            cmd = lag_study.train_command(args, "NAME", lag, cap, 2, 1234)
            assert cmd[:len(TRAINER_ARGS["full"])] == TRAINER_ARGS["full"]
            cfg = parse_flags(Config, args=cmd[len(TRAINER_ARGS["full"]):])  # every flag is the full trainer's
            assert (cfg.max_policy_lag, cfg.tis_cap, cfg.seed, cfg.save_every, cfg.steps, cfg.ref_url) == \
                (lag, cap, 2, 25, 650 if lag == 1 else 700, "http://127.0.0.1:1234")
            assert cmd[cmd.index("--ref_url") + 2:][:len(TINY_WORLD_FLAGS)] == TINY_WORLD_FLAGS  # tools/demo.py's


def test_the_dry_run_lists_the_18_runs_in_the_registered_order():
    done = subprocess.run([sys.executable, "tools/lag_study.py", "--dry_run", "--name", "test_lag_study"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    runs = [line.split(":")[0][len("run "):] for line in done.stdout.splitlines() if line.startswith("run ")]
    assert runs == [f"test_lag_study_lag{lag}_cap{cap}_seed{seed}"
                    for seed in (0, 1, 2) for cap in (2, 0) for lag in (1, 2, 4)]
    assert not os.path.exists(os.path.join(runs_root(), "test_lag_study_lag1_cap2_seed0"))


@pytest.mark.parametrize("low, high, phrases", [
    (-1.0, 1.0, ["no difference detected", "level", "no loss"]),
    (-1.0, 2.0, ["no difference detected", "no loss"]),  # holds 0 but reaches past +1.5: not "level"
    (-2.0, 1.0, ["no difference detected", "undecided: a loss of up to 2.0 points is not ruled out"]),
    (-3.0, -0.5, ["a loss"]),
    (-1.2, -0.2, ["level", "no loss", "a loss"]),
    (0.5, 2.0, ["no loss", "a gain"]),
    (0.0, 3.0, ["no difference detected", "no loss"]),
])
def test_the_wording_is_every_registered_phrase_that_applies_and_no_other(low, high, phrases):
    assert lag_study.wording(low, high) == phrases


def rows(scores):
    return [{"question": f"q{i}", "scores": [{"correctness": s}]} for i, s in enumerate(scores)]


def test_the_registered_difference_averages_each_problem_over_the_seeds_then_takes_the_normal_interval():
    # seed 0: differences 0, 1, -1, 0; seed 1: 1, 0, 0, 0; per problem over the seeds: 0.5, 0.5, -0.5, 0
    pairs = [(rows([1, 0, 1, 0]), rows([1, 1, 0, 0])), (rows([0, 0, 1, 1]), rows([1, 0, 1, 1]))]
    points, (low, high) = lag_study.paired_over_seeds(pairs)
    sd = math.sqrt(((0.5 - 0.125) ** 2 * 2 + (-0.5 - 0.125) ** 2 + 0.125 ** 2) / 3)
    assert points == pytest.approx(12.5)
    assert (low, high) == pytest.approx((12.5 - 196 * sd / 2, 12.5 + 196 * sd / 2))
    with pytest.raises(ValueError, match="same problems"):
        lag_study.paired_over_seeds([(rows([1, 0]), rows([1, 0])), (rows([1, 0, 1]), rows([1, 0, 1]))])


def test_the_budget_is_lag_1s_summed_step_time_over_steps_2_to_650_and_the_lag_k_run_stops_at_the_last_fit():
    lag1 = {1: 30.0, **{s: 1.0 for s in range(2, 651)}}  # step 1 holds vLLM's start-up: left out
    b = lag_study.budget(lag1)
    assert b == pytest.approx(649.0)
    faster = {1: 30.0, **{s: 0.8 for s in range(2, 2001)}}  # 0.8 x (N - 1) <= 649: N <= 812, saved every 25
    assert lag_study.budget_step(faster, b, range(25, 2001, 25)) == (800, False)
    slower = {1: 30.0, **{s: 1.25 for s in range(2, 2001)}}  # N <= 520.2
    assert lag_study.budget_step(slower, b, range(25, 2001, 25)) == (500, False)
    much_faster = {1: 30.0, **{s: 0.1 for s in range(2, 2001)}}  # reaches its last step within the budget
    assert lag_study.budget_step(much_faster, b, range(25, 2001, 25)) == (2000, True)
    assert lag_study.budget_step({1: 1.0, 2: 700.0}, b, [25]) is None
    with pytest.raises(ValueError, match="missing, from step 300"):
        lag_study.budget({s: 1.0 for s in range(1, 651) if s != 300})


def write(path, correct, n=100):
    with open(path, "w") as f:
        for row in rows([1] * correct + [0] * (n - correct)):
            f.write(json.dumps(row) + "\n")


def test_the_analysis_gives_the_8_registered_comparisons_and_the_secondary_ones(tmp_path):
    runs = {}
    for seed in (0, 1, 2):
        for cap in (2, 0):
            for lag in (1, 2, 4):
                entry = {"lag": lag, "cap": cap, "seed": seed}
                right = 50 + (lag - 1) * seed + cap  # of 100: lag k gains (k - 1) x seed problems on lag 1
                write(tmp_path / f"{lag}{cap}{seed}.jsonl", right)
                entry["steps_details"] = str(tmp_path / f"{lag}{cap}{seed}.jsonl")
                if lag != 1:
                    write(tmp_path / f"{lag}{cap}{seed}b.jsonl", right - 1)
                    entry.update(budget_details=str(tmp_path / f"{lag}{cap}{seed}b.jsonl"), budget_step=600,
                                 budget_reached_last=False)
                runs[f"lag{lag}_cap{cap}_seed{seed}"] = entry
    report = lag_study.analyse(runs)
    assert len(report["registered"]) == 8 and report["complete"]
    e = report["registered"]["lag 2 - lag 1, tis_cap 2, same steps (650)"]
    assert e["points"] == 1.0 and e["seeds"] == [0, 1, 2]  # 0, 1 and 2 problems of 100 over the seeds
    assert [p["points"] for p in e["per_seed"].values()] == [0.0, 1.0, 2.0]
    assert e["across_seeds"]["points"] == 1.0 and e["ci95"][0] < 0 < e["ci95"][1]
    assert e["wording"][0] == "no difference detected"
    assert report["registered"]["lag 4 - lag 1, tis_cap 0, same budget"]["points"] == 2.0  # 3 x seed - 1, mean 2
    assert report["secondary"]["tis_cap 2 - tis_cap 0, lag 4, same steps (650)"]["points"] == 2.0
    assert report["budget_steps"]["lag 2, tis_cap 0"] == {"0": [600, False], "1": [600, False], "2": [600, False]}
    del runs["lag4_cap0_seed2"]  # a study not yet finished: what is there, and said to be incomplete
    partial = lag_study.analyse(runs)
    assert not partial["complete"] and partial["registered"]["lag 4 - lag 1, tis_cap 0, same budget"]["seeds"] == [0, 1]


@pytest.mark.parametrize("flags, refusal", [
    (["--steps_lagk", "660"], "a multiple of 25"),
    (["--steps_lag1", "600"], "at least 650"),
    (["--analyse_only", "--name", "test_lag_study_none"], "no run of the study"),
    (["--dry_run", "--analyse_only"], "pick one")])
def test_flags_it_cannot_act_on_are_refused_by_name(flags, refusal):
    done = subprocess.run([sys.executable, "tools/lag_study.py", *flags], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0 and refusal in done.stderr


def test_the_curves_put_each_run_on_the_trainers_clock(tmp_path):
    runs = {}
    for cap in (2, 0):
        for lag in (1, 2):
            name = f"test_lag_study_curves_lag{lag}_cap{cap}_seed0"
            os.makedirs(os.path.join(ROOT, runs_root(), name), exist_ok=True)
            with open(os.path.join(ROOT, runs_root(), name, "metrics.jsonl"), "w") as f:
                for step in range(1, 81):
                    f.write(json.dumps({"step": step, "step_s": 0.5 * lag, "accuracy": step / 100}) + "\n")
                f.write(json.dumps({"step": 40, "warning": "kl", "message": "a doctor's row: no step_s"}) + "\n")
            runs[name] = {"lag": lag, "cap": cap, "seed": 0}
    lag_study.plot_curves(runs, str(tmp_path / "curves.png"))
    with open(tmp_path / "curves.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
