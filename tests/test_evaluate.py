"""evaluate.py on the shipped model: the accuracy and format windows that leave RL room to gain."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_evaluate(*args):
    cmd = [sys.executable, "evaluate.py", "--model", "models/tiny-math",
           "--dataset", "data/toy_math/test.jsonl", "--json", *args]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "accuracy" in out.stdout and "format_rate" in out.stdout  # the table
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_greedy_accuracy_of_the_shipped_model_is_in_the_window():
    result = run_evaluate()
    assert result["n"] == 500
    assert 0.15 <= result["accuracy"] <= 0.45, result


def test_sampled_format_rate_of_the_shipped_model_is_in_the_window():
    result = run_evaluate("--temperature", "1.0", "--samples", "4")
    assert result["samples"] == 4 and "pass_at_k" in result
    assert 0.20 <= result["format_rate"] <= 0.80, result
    assert result["pass_at_k"] >= result["accuracy"]


def test_transformers_backend_gives_the_same_kind_of_report():
    result = run_evaluate("--backend", "hf", "--n", "64")
    assert result["n"] == 64 and 0.0 <= result["accuracy"] <= 1.0


def test_greedy_with_several_samples_is_refused():
    out = subprocess.run([sys.executable, "evaluate.py", "--samples", "4"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--temperature" in out.stderr
