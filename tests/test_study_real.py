"""tools/study_real.py, issue 50's pre-registered study: its commands (each arm on the correctness reward alone,
otherwise one recipe), and its analysis (pass@k, the verdict on GRPO - RAFT with its 90% interval across runs
against a 3-point margin), on written evaluations; the study itself (~7 hours) is not run here."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from simple_grpo.evaluation import equivalence_verdict, pass_at_k, pass_at_k_curve
from simple_grpo.flags import parse_flags
from simple_grpo.run.checkpoints import runs_root
from tools.launch import ROOT, TRAINER_ARGS
from tools import study_real


def test_pass_at_k_is_the_unbiased_estimate():
    assert pass_at_k(8, 0, 1) == 0 and pass_at_k(8, 8, 1) == 1
    assert pass_at_k(8, 2, 1) == pytest.approx(2 / 8)
    assert pass_at_k(8, 2, 8) == 1  # 8 of 8 drawn: the 2 correct ones are among them
    assert pass_at_k(8, 1, 4) == pytest.approx(1 - (7 * 6 * 5 * 4) / (8 * 7 * 6 * 5))  # 1 - C(7,4)/C(8,4) = 0.5
    with pytest.raises(ValueError):
        pass_at_k(8, 9, 1)


def test_pass_at_k_curve_averages_over_problems_for_every_k():
    rows = [{"scores": [{"correctness": c} for c in (1, 0, 0, 0)]}, {"scores": [{"correctness": 0}] * 4}]
    curve = pass_at_k_curve(rows)
    assert list(curve) == [1, 2, 3, 4]
    assert curve[1] == pytest.approx(0.125) and curve[4] == pytest.approx(0.5)


@pytest.mark.parametrize("low, high, verdict", [(-2.0, 2.5, "equivalent"), (0.5, 6.0, "A ahead"),
                                                (-7.0, -1.0, "B ahead"), (-4.0, 1.0, "undecided")])
def test_the_equivalence_verdict_follows_the_pre_registered_rule(low, high, verdict):
    assert equivalence_verdict(low, high, 3.0) == verdict


def test_every_arm_trains_on_the_correctness_reward_alone_with_one_recipe_and_two_checkpoints():
    from simple_grpo.train import Config
    args = SimpleNamespace(name="study50", steps=80)
    commands = {arm: study_real.train_command(args, "START", "answers.jsonl", 1, 2, arm)[1] for arm in study_real.ARMS}
    for arm, cmd in commands.items():
        cfg = parse_flags(Config, args=cmd[len(TRAINER_ARGS["full"]):])  # every flag is the full trainer's
        assert (cfg.reward_funcs, cfg.reward_weights, cfg.steps, cfg.save_every, cfg.seed) == \
            ("correctness", "1.0", 80, 40, 2)
    configs = {arm: parse_flags(Config, args=cmd[len(TRAINER_ARGS["full"]):]) for arm, cmd in commands.items()}
    assert configs["raft"].advantage_estimator == "raft"
    assert (configs["reinforce_rej"].advantage_estimator, configs["reinforce_rej"].scale_rewards) == ("grpo", "none")
    assert (configs["grpo"].advantage_estimator, configs["grpo"].scale_rewards) == ("grpo", "group")
    def recipe(cmd, arm):  # the command less the arm's own flags and its run's name
        name = cmd.index("--run_name")
        return [a for a in cmd[:name] + cmd[name + 2:] if a not in study_real.ARMS[arm]]
    assert recipe(commands["grpo"], "grpo") == recipe(commands["raft"], "raft") == \
        recipe(commands["reinforce_rej"], "reinforce_rej")  # otherwise one recipe


def test_the_dry_run_lists_two_starts_three_seeds_three_arms(tmp_path):
    done = subprocess.run([sys.executable, "tools/study_real.py", "--dry_run", "--name", "test_study"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    runs = [line for line in done.stdout.splitlines() if line.startswith("run ")]
    assert len(runs) == 18 and not os.path.exists(os.path.join(runs_root(), "test_study_start0_seed0_grpo"))


def write_details(path, correct):
    with open(path, "w") as f:
        for c in correct:
            f.write(json.dumps({"question": "q", "scores": [{"correctness": c}]}) + "\n")


def test_the_analysis_gives_grpo_minus_raft_per_run_and_the_verdict(tmp_path, monkeypatch):
    runs = {}
    for start in (0, 1):
        for seed in (0, 1, 2):
            for arm, right in (("grpo", 52 + seed), ("raft", 50), ("reinforce_rej", 50)):  # of 100 problems
                path = tmp_path / f"s{start}{seed}{arm}.jsonl"
                write_details(path, [1] * right + [0] * (100 - right))
                runs[f"start{start}_seed{seed}_{arm}"] = {"start": f"start{start}", "seed": seed, "arm": arm,
                                                           "greedy": str(path), "greedy_half": str(path),
                                                           "passk": str(path)}
        start_file = tmp_path / f"start{start}.jsonl"  # start 0 right on 48 problems, start 1 on 51
        write_details(start_file, [1] * (48 + 3 * start) + [0] * (52 - 3 * start))
        runs[f"start{start}"] = {"greedy": str(start_file), "passk": str(start_file)}
    args = SimpleNamespace(steps=80, starts=[0, 1], seeds=[0, 1, 2], name=str(tmp_path / "study"))
    os.makedirs(args.name)
    monkeypatch.setattr(study_real, "study_dir", lambda a: a.name)  # the plot goes beside the runs
    report = study_real.analyse(runs, args)
    primary = report["comparisons"]["grpo - raft (greedy)"]
    assert primary["per_run"] == [2.0, 3.0, 4.0, 2.0, 3.0, 4.0] and primary["mean"] == 3.0
    assert report["verdict"] == primary["verdict"] == "grpo ahead"  # 90% interval [2.3, 3.7]: above 0, past +3
    assert report["complete"] and os.path.isfile(os.path.join(args.name, "pass_at_k.png"))
    to_start = report["comparisons"]["grpo - start (greedy)"]  # each run against its own start
    assert to_start["per_run"] == [4.0, 5.0, 6.0, 1.0, 2.0, 3.0] and to_start["mean"] == 3.5
    assert report["comparisons"]["raft - start (greedy_half)"]["per_run"] == [2.0, 2.0, 2.0, -1.0, -1.0, -1.0]
    assert report["pass_at_k"]["start"]["1"] == pytest.approx((0.48 + 0.51) / 2)
    assert report["accuracy"] == {"start (greedy)": 0.495, "grpo (greedy)": 0.53, "grpo (greedy_half)": 0.53,
                                  "raft (greedy)": 0.5, "raft (greedy_half)": 0.5, "reinforce_rej (greedy)": 0.5,
                                  "reinforce_rej (greedy_half)": 0.5}


def samples(correct_counts, n=8, questions=None):
    """write_details rows: problem i sampled n times, correct_counts[i] of them right."""
    questions = questions or [f"q{i}" for i in range(len(correct_counts))]
    return [{"question": q, "scores": [{"correctness": int(j < c)} for j in range(n)]}
            for q, c in zip(questions, correct_counts)]


def test_pass_at_k_is_compared_problem_by_problem_on_the_same_problems():
    a, b = samples([2, 8, 0]), samples([1, 8, 1])
    diff = study_real.paired_pass_at_k(a, b)
    assert list(diff) == list(range(1, 9))
    assert diff[1] == pytest.approx(0.0)  # (2 - 1) / 8 on the first problem, (0 - 1) / 8 on the third
    assert diff[8] == pytest.approx(-100 / 3)  # in 8 samples both reach the first two; only b the third
    assert study_real.paired_pass_at_k(samples([3, 0]), samples([0, 0]))[8] == pytest.approx(50.0)
    with pytest.raises(ValueError, match="same problems in the same order"):
        study_real.paired_pass_at_k(a, samples([1, 8, 1], questions=["q1", "q0", "q2"]))
    with pytest.raises(ValueError, match="same number of samples"):
        study_real.paired_pass_at_k(a, samples([1, 4, 1], n=4))


def test_the_analysis_gives_each_runs_paired_pass_at_k_difference_and_the_interval_across_runs(tmp_path, monkeypatch):
    runs = {}
    for start in (0, 1):
        start_passk = tmp_path / f"start{start}_passk.jsonl"
        write_rows(start_passk, samples([0, 2, 8, 4]))
        write_details(tmp_path / f"start{start}.jsonl", [1, 0])
        runs[f"start{start}"] = {"greedy": str(tmp_path / f"start{start}.jsonl"), "passk": str(start_passk)}
        for seed in (0, 1, 2):
            for arm, counts in (("grpo", [seed, 2, 8, 4]), ("raft", [0, 2, 8, 4]), ("reinforce_rej", [0, 1, 8, 4])):
                passk = tmp_path / f"s{start}{seed}{arm}_passk.jsonl"
                write_rows(passk, samples(counts))
                runs[f"start{start}_seed{seed}_{arm}"] = {
                    "start": f"start{start}", "seed": seed, "arm": arm, "passk": str(passk),
                    "greedy": runs[f"start{start}"]["greedy"], "greedy_half": runs[f"start{start}"]["greedy"]}
    args = SimpleNamespace(steps=80, starts=[0, 1], seeds=[0, 1, 2], name=str(tmp_path / "study"))
    os.makedirs(args.name)
    monkeypatch.setattr(study_real, "study_dir", lambda a: a.name)
    paired = study_real.analyse(runs, args)["pass_at_k_paired"]
    grpo_start = paired["grpo - start"]
    assert list(grpo_start) == [str(k) for k in range(1, 9)]
    # pass@1: seed s has s of 8 right on the one problem the start never gets: 100 * s/8 / 4 problems
    assert grpo_start["1"]["per_run"] == [0.0, 3.12, 6.25, 0.0, 3.12, 6.25] and grpo_start["1"]["mean"] == 3.12
    assert grpo_start["1"]["interval"] == [0.83, 5.42]  # 90%: 3.125 +- t(5) 2.015 x standard error 1.141
    assert grpo_start["8"]["per_run"] == [0.0, 25.0, 25.0, 0.0, 25.0, 25.0]  # reached at all in 8: a quarter more
    assert paired["grpo - raft"]["1"] == grpo_start["1"]  # RAFT is the start here, run for run
    assert paired["raft - start"]["4"]["per_run"] == [0.0] * 6 and paired["raft - start"]["4"]["interval"] == [0, 0]
    assert paired["reinforce_rej - start"]["1"]["mean"] == -3.12  # one of 8 fewer on 1 of 4 problems


def write_rows(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


@pytest.mark.parametrize("flags, refusal", [(["--steps", "3"], "give an even number"),
                                            (["--analyse_only", "--name", "test_study_none"], "no run of the study"),
                                            (["--dry_run", "--analyse_only"], "pick one")])
def test_flags_it_cannot_act_on_are_refused_by_name(flags, refusal):
    done = subprocess.run([sys.executable, "tools/study_real.py", *flags], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0 and refusal in done.stderr
