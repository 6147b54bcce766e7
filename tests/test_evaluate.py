"""evaluate.py on the shipped model: the accuracy and format windows that leave RL room to gain."""
import json
import math
import os
import subprocess
import sys

import pytest

from simple_grpo.evaluation import (across_seeds, details_accuracy, paired_gain, print_before_after, read_details,
                                    summarize, t_quantile, write_details)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_evaluate(*args):
    cmd = [sys.executable, "evaluate.py", "--model", "models/tiny-math",
           "--dataset", "data/toy_math/test.jsonl", "--json", *args]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "accuracy" in out.stdout and "format_rate" in out.stdout  # the table
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def greedy(tmp_path_factory):
    """The shipped model's greedy evaluation on the 500 test problems (vLLM), with --details: its JSON line and
    the details file (one vLLM start for the tests that read them)."""
    path = tmp_path_factory.mktemp("greedy") / "details.jsonl"
    return run_evaluate("--details", str(path)), path


@pytest.fixture(scope="module")
def hf_run():
    """evaluate.py --backend hf --n 16 with the default model, data set and device: its stdout and JSON line."""
    out = subprocess.run([sys.executable, "evaluate.py", "--backend", "hf", "--n", "16", "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout, json.loads(out.stdout.strip().splitlines()[-1])


def test_greedy_accuracy_of_the_shipped_model_is_in_the_window(greedy):
    result, _ = greedy
    assert result["n"] == 500
    assert 0.15 <= result["accuracy"] <= 0.45, result


def test_sampled_format_rate_of_the_shipped_model_is_in_the_window():
    result = run_evaluate("--temperature", "1.0", "--samples", "4", "--n", "200")  # 800 samples: ~0.02 of spread
    assert result["samples"] == 4 and "pass_at_k" in result
    assert 0.20 <= result["format_rate"] <= 0.80, result
    assert result["pass_at_k"] >= result["accuracy"]


def test_transformers_backend_gives_the_same_kind_of_report(hf_run):
    stdout, result = hf_run
    assert "accuracy" in stdout and "format_rate" in stdout  # the table
    assert result["n"] == 16 and 0.0 <= result["accuracy"] <= 1.0


def test_the_report_names_the_device_the_default_picked_here(hf_run):
    """--device auto: the first visible GPU where torch sees one (tests/test_gpu.py), the CPU on this machine."""
    stdout, _ = hf_run
    assert "models/tiny-math on data/toy_math/test.jsonl (greedy, hf, float32, cpu)" in stdout


def test_greedy_with_several_samples_is_refused():
    out = subprocess.run([sys.executable, "evaluate.py", "--samples", "4"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--temperature" in out.stderr


def test_details_hold_each_problem_and_pair_into_a_gain(greedy):
    result, path = greedy
    rows = read_details(path)
    assert len(rows) == 500 and rows[0]["answer"] and len(rows[0]["completions"]) == 1
    assert sum(r["scores"][0]["correctness"] for r in rows) / 500 == result["accuracy"]
    same = paired_gain(rows, rows)  # a model against itself gains nothing, with no spread
    assert same["gain"] == 0 and same["ci95"] == [0, 0] and same["won"] == same["lost"] == 0


def test_paired_gain_is_the_mean_difference_with_its_interval():
    def rows(correct):
        return [{"question": f"q{i}", "scores": [{"correctness": float(c)}]} for i, c in enumerate(correct)]
    before, after = rows([0, 0, 0, 1, 1, 0, 0, 0]), rows([1, 1, 0, 1, 0, 1, 0, 0])
    gain = paired_gain(before, after)
    # differences 1, 1, 0, 0, -1, 1, 0, 0: mean 0.25; squared deviations 3 * 0.75^2 + 4 * 0.25^2 + 1.25^2 = 3.5
    assert gain["gain"] == 0.25 and gain["won"] == 3 and gain["lost"] == 1
    half = 1.96 * math.sqrt(3.5 / 7) / math.sqrt(8)
    assert gain["ci95"] == pytest.approx([0.25 - half, 0.25 + half])
    with pytest.raises(ValueError, match="not on the same problems"):
        paired_gain(before, after[::-1])


def test_across_seeds_is_the_mean_with_a_t_interval():
    figure = across_seeds([0.02, 0.06, 0.04])
    # mean 0.04, standard deviation 0.02, standard error 0.02 / sqrt(3); t with 2 degrees of freedom 4.3026527
    half = 4.3026527 * 0.02 / math.sqrt(3)
    assert figure["mean"] == pytest.approx(0.04) and figure["seeds"] == 3
    assert figure["ci95"] == pytest.approx([0.04 - half, 0.04 + half])
    with pytest.raises(ValueError, match="2 or more seeds"):
        across_seeds([0.5])


def test_t_quantile_is_students_t_at_any_degrees_of_freedom():
    # the two-sided 95% quantiles of the printed tables
    for df, t in ((1, 12.7062047), (2, 4.3026527), (5, 2.5705818), (10, 2.2281389), (14, 2.1447867),
                  (29, 2.0452296), (120, 1.9799304)):
        assert t_quantile(0.95, df) == pytest.approx(t, abs=1e-6), df
    assert t_quantile(0.90, 2) == pytest.approx(2.9199856, abs=1e-6)
    with pytest.raises(ValueError, match="integer df >= 1"):
        t_quantile(0.95, 0)


def test_across_fifteen_seeds_the_interval_uses_t_not_1_96():
    values = [0.5 + 0.01 * (i % 5) for i in range(15)]
    figure = across_seeds(values)
    mean = sum(values) / 15
    se = math.sqrt(sum((v - mean) ** 2 for v in values) / 14) / math.sqrt(15)
    assert figure["ci95"] == pytest.approx([mean - 2.1447867 * se, mean + 2.1447867 * se])  # 14 degrees of freedom
    assert (figure["ci95"][1] - mean) / se == pytest.approx(2.1447867)  # not the normal's 1.96


def test_accuracy_from_details_scores_every_sample_of_every_problem():
    rows = [{"question": "q0", "scores": [{"correctness": 1.0}, {"correctness": 0.0}, {"correctness": 1.0}]},
            {"question": "q1", "scores": [{"correctness": 0.0}, {"correctness": 0.0}, {"correctness": 1.0}]}]
    assert details_accuracy(rows) == pytest.approx(3 / 6)  # not 1 / 2 by chance: the first samples give 1 of 2
    assert details_accuracy(rows[:1]) == pytest.approx(2 / 3)  # the first sample alone would say 1.0


def test_paired_gain_compares_each_problems_mean_over_its_samples():
    before = [{"question": "q0", "scores": [{"correctness": 1.0}, {"correctness": 0.0}]},
              {"question": "q1", "scores": [{"correctness": 0.0}, {"correctness": 0.0}]}]
    after = [{"question": "q0", "scores": [{"correctness": 1.0}, {"correctness": 1.0}]},
             {"question": "q1", "scores": [{"correctness": 0.0}, {"correctness": 1.0}]}]
    gain = paired_gain(before, after)  # per problem +0.5 and +0.5; the first samples alone would say 0
    assert gain["gain"] == pytest.approx(0.5) and gain["won"] == 2 and gain["lost"] == 0


def write_seed_run(run_dir, evals, start_key="k0"):
    """A demo run directory as tools/seed_table.py reads it: eval_NAME.jsonl per model (one row per problem,
    each score a list of per-sample correctness) and report.json naming its start."""
    run_dir.mkdir()
    for name, problems in evals.items():
        with open(run_dir / f"eval_{name}.jsonl", "w") as f:
            for i, samples in enumerate(problems):
                scores = [{"correctness": c, "strict": c} for c in samples]
                f.write(json.dumps({"question": f"q{i}", "scores": scores}) + "\n")
    with open(run_dir / "report.json", "w") as f:
        json.dump({"start_made": {"dir": f".cache/models/start-{start_key}", "key": start_key}}, f)


def seed_table(*args):
    return subprocess.run([sys.executable, "tools/seed_table.py", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_seed_table_pairs_each_seed_and_reads_across_them(tmp_path):
    """tools/seed_table.py on two seeds' evaluations of four problems: a model that gains 1 and 2 problems."""
    for run, grpo in (("seed0", [1, 1, 0, 0]), ("seed1", [1, 1, 1, 0])):
        write_seed_run(tmp_path / run, {"start": [[1], [0], [0], [0]], "grpo": [[c] for c in grpo]})
    out = seed_table(tmp_path / "seed0", tmp_path / "seed1", "--models", "start,grpo", "--against", "start")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["accuracy"]["grpo"]["per_seed"] == [0.5, 0.75]
    gain = report["gains"]["start"]
    assert [g["gain"] for g in gain["per_seed"]] == [0.25, 0.5] and gain["mean"] == pytest.approx(0.375)
    half = 12.7062047 * 0.125 / math.sqrt(2) * math.sqrt(2)  # standard deviation 0.125 * sqrt(2) of two gains
    assert gain["ci95"] == pytest.approx([0.375 - half, 0.375 + half])
    assert report["start"]["key"] == "k0"
    assert "| start | +25.0" in out.stdout
    missing = seed_table(tmp_path / "seed0", tmp_path / "seed1")
    assert missing.returncode != 0 and "eval_base.jsonl not found" in missing.stderr


def test_seed_table_scores_every_sample_of_a_sampled_evaluation(tmp_path):
    write_seed_run(tmp_path / "seed0", {"start": [[1, 0], [0, 0]], "grpo": [[1, 1], [0, 1]]})
    write_seed_run(tmp_path / "seed1", {"start": [[1, 1], [0, 0]], "grpo": [[1, 1], [1, 1]]})
    out = seed_table(tmp_path / "seed0", tmp_path / "seed1", "--models", "start,grpo", "--against", "start")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["accuracy"]["start"]["per_seed"] == [0.25, 0.5]  # the first samples alone: 0.5 and 0.5
    assert report["accuracy"]["grpo"]["per_seed"] == [0.75, 1.0]
    assert [g["gain"] for g in report["gains"]["start"]["per_seed"]] == [0.5, 0.5]


def test_seed_table_refuses_runs_from_different_starts(tmp_path):
    evals = {"start": [[1], [0]], "grpo": [[1], [1]]}
    write_seed_run(tmp_path / "seed0", evals, start_key="aaaa")
    write_seed_run(tmp_path / "seed1", evals, start_key="bbbb")
    out = seed_table(tmp_path / "seed0", tmp_path / "seed1", "--models", "start,grpo", "--against", "start")
    assert out.returncode != 0 and "different starts" in out.stderr
    assert f"{tmp_path / 'seed0'}: .cache/models/start-aaaa (key aaaa)" in out.stderr
    assert f"{tmp_path / 'seed1'}: .cache/models/start-bbbb (key bbbb)" in out.stderr


def test_seed_table_refuses_a_run_whose_report_names_no_start(tmp_path):
    evals = {"start": [[1], [0]], "grpo": [[1], [1]]}
    write_seed_run(tmp_path / "seed0", evals)
    write_seed_run(tmp_path / "seed1", evals)
    with open(tmp_path / "seed1" / "report.json", "w") as f:
        json.dump({"grpo_minutes": 6.0}, f)  # a report from before the start was recorded
    out = seed_table(tmp_path / "seed0", tmp_path / "seed1", "--models", "start,grpo", "--against", "start")
    assert out.returncode != 0 and f"{tmp_path / 'seed1' / 'report.json'} names no start" in out.stderr


def test_an_answer_prefix_starts_every_answer_and_is_scored_with_it(tmp_path):
    path = tmp_path / "details.jsonl"
    # the transformers backend: the prefix is evaluate.py's, whatever generates (and no vLLM start)
    run_evaluate("--n", "16", "--answer_prefix", "<think>", "--details", str(path), "--backend", "hf")
    rows = read_details(path)
    assert all(r["completions"][0].startswith("<think>") for r in rows)  # scored with the prefix
    # the tiny model begins its own answers with <think>: had the prompt not ended with it, it would write it again
    assert sum(r["completions"][0].startswith("<think><think>") for r in rows) < len(rows) / 2


# ---------------------------------------------------------------- accuracy under answer_is, on hand-made completions
PROBLEMS = [{"question": "3 + 4?", "answer": "3 + 4 = 7\n#### 7"},
            {"question": "10 * 100?", "answer": "10 * 100 = 1000\n#### 1,000"}]
COMPLETIONS = [["3 + 4 = 7.\nThe answer is 7.", "The answer is 8."],  # one right in its own words
               ["<think>10*100=1000</think><answer>1000</answer>", "**The final answer is: $1,000**"]]
LENGTHS = [[9, 5], [12, 10]]


def test_accuracy_under_answer_is_counts_the_stated_answers():
    result = summarize(PROBLEMS, COMPLETIONS, LENGTHS, accuracy_reward="answer_is")
    assert result["accuracy"] == 0.5 and result["pass_at_k"] == 1.0  # 2 of 4 right; each problem once
    assert result["format_rate"] == 0.25 and result["accuracy_in_format"] == 0.0  # the tagged one states nothing
    by_tags = summarize(PROBLEMS, COMPLETIONS, LENGTHS)  # the default: correctness, the <answer> tags
    assert by_tags["accuracy"] == 0.25 and by_tags["pass_at_k"] == 0.5 and by_tags["accuracy_in_format"] == 1.0


def test_details_under_answer_is_hold_it_for_a_paired_gain(tmp_path):
    write_details(tmp_path / "tags.jsonl", PROBLEMS, COMPLETIONS)
    write_details(tmp_path / "stated.jsonl", PROBLEMS, COMPLETIONS, accuracy_reward="answer_is")
    tags, stated = read_details(tmp_path / "tags.jsonl"), read_details(tmp_path / "stated.jsonl")
    assert list(tags[0]["scores"][0]) == ["correctness", "format", "reward", "strict"]  # the default rows
    assert list(stated[0]["scores"][0]) == ["correctness", "format", "answer_is", "reward", "strict"]
    assert [r["scores"][0]["answer_is"] for r in stated] == [1.0, 0.0]  # first completions: stated 7, tags only
    before = [dict(r, scores=[{"answer_is": 0.0}]) for r in stated]
    assert paired_gain(before, stated, key="answer_is")["gain"] == 0.5


def test_an_unknown_accuracy_reward_names_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown reward function\(s\) \['answer'\]; known: \['answer_is'"):
        summarize(PROBLEMS, COMPLETIONS, LENGTHS, accuracy_reward="answer")
    out = subprocess.run([sys.executable, "evaluate.py", "--accuracy_reward", "answer"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "unknown --accuracy_reward 'answer': use one of answer_is, correctness, format" in out.stderr


# ---------------------------------------------------------------- the strict integer re-score beside math-verify's
STRICT_PROBLEMS = [{"question": f"q{i}", "answer": f"...\n#### {gold}"}
                   for i, gold in enumerate(["50", "50", "50", "1,000"])]
STRICT_COMPLETIONS = [["<think>x</think><answer>21+29</answer>"],  # math-verify: 50; strict: an expression
                      ["<think>x</think><answer>50</answer>"],
                      ["<think>x</think><answer> 50 </answer>"],
                      ["<think>x</think><answer>$1,000</answer>"]]  # math-verify: 1000; strict: a currency sign
STRICT_LENGTHS = [[10]] * 4


def test_accuracy_strict_counts_only_plain_integers_beside_math_verify_accuracy():
    result = summarize(STRICT_PROBLEMS, STRICT_COMPLETIONS, STRICT_LENGTHS)
    assert result["accuracy"] == 1.0 and result["accuracy_strict"] == 0.5
    assert list(result) == ["accuracy", "accuracy_strict", "format_rate", "accuracy_in_format", "pass_at_k",
                            "mean_tokens", "n", "samples"]  # the others keep their names and order


def test_details_hold_the_strict_score_for_a_paired_gain(tmp_path):
    write_details(tmp_path / "details.jsonl", STRICT_PROBLEMS, STRICT_COMPLETIONS)
    rows = read_details(tmp_path / "details.jsonl")
    assert [r["scores"][0]["correctness"] for r in rows] == [1.0, 1.0, 1.0, 1.0]
    assert [r["scores"][0]["strict"] for r in rows] == [0.0, 1.0, 1.0, 0.0]
    nothing = [dict(r, scores=[{"strict": 0.0, "correctness": 0.0}]) for r in rows]
    assert paired_gain(nothing, rows, key="strict")["gain"] == 0.5
    assert paired_gain(nothing, rows)["gain"] == 1.0


def test_the_before_after_table_has_a_strict_column_only_where_the_report_has_it(capsys):
    row = {"accuracy": 0.5, "format_rate": 1.0, "accuracy_in_format": 0.5, "n": 4}
    print_before_after({"before": row, "after": row}, ("before", "after"), "")
    without = capsys.readouterr().out.splitlines()[1]
    assert without == f"{'':<8}{'accuracy':>10}{'format':>10}{'acc in format':>15}"  # tools/demo.py's, as before
    strict = dict(row, accuracy_strict=0.25)
    print_before_after({"before": strict, "after": strict}, ("before", "after"), "")
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == f"{'':<8}{'accuracy':>10}{'strict':>10}{'format':>10}{'acc in format':>15}"
    assert lines[2] == f"{'before':<8}{'0.500':>10}{'0.250':>10}{'1.000':>10}{'0.500':>15}"
    assert json.loads(lines[-1])["before"]["accuracy_strict"] == 0.25


def test_the_json_line_carries_the_strict_accuracy(hf_run):
    _, result = hf_run
    assert 0.0 <= result["accuracy_strict"] <= result["accuracy"], result
