"""tools/probe.py (simple_grpo/run/probe.py): the pre-flight probe's figures and verdicts (vLLM on the tiny world: ~20 s a run).

    python -m pytest -q tests/test_probe.py                # the tiny world
    python -m pytest -q -m slow tests/test_probe.py        # SmolLM2-135M-Instruct too
"""
import json
import os
import subprocess
import sys

import pytest

from tests.test_smollm2 import save_figures, smollm2  # noqa: F401 - the converted model fixture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = {"n", "G", "pass_rate_hist", "format_rate", "truncated_frac", "zero_var_frac", "mean_len", "verdict"}
NEVER_REWARD = '''
from simple_grpo.task.rewards import reward_function


@reward_function("never")
def never(completion, answer):
    return 0.0
'''


def run_probe(*args, timeout=600):
    """The probe's exit status, its output and its last line parsed as JSON (None when it failed)."""
    out = subprocess.run([sys.executable, "tools/probe.py", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout)
    if out.returncode != 0:
        return out.returncode, out.stdout + out.stderr, None
    return 0, out.stdout + out.stderr, json.loads(out.stdout.strip().splitlines()[-1])


def check_consistent(result, n, G, max_new_tokens):
    assert KEYS <= set(result), result
    assert result["n"] == n and result["G"] == G
    assert len(result["pass_rate_hist"]) == G + 1 and sum(result["pass_rate_hist"]) == n
    for key in ("format_rate", "truncated_frac", "zero_var_frac"):
        assert 0.0 <= result[key] <= 1.0, (key, result)
    assert 0 < result["mean_len"] <= max_new_tokens
    assert result["verdict"].strip()


@pytest.fixture(scope="module")
def tiny_probe(tmp_path_factory):
    """One probe of the tiny world (16 prompts x 4) that also logs two groups' completions as step 7: the
    exit status, output, JSON line and the completions file (one vLLM start for the two tests below)."""
    path = tmp_path_factory.mktemp("probe") / "completions.jsonl"
    rc, output, result = run_probe("--n", "16", "--num_generations", "4", "--log_completions", str(path),
                                   "--log_groups", "2", "--log_step", "7")
    return rc, output, result, path


def test_the_json_line_on_the_tiny_world_holds_consistent_figures(tiny_probe):
    rc, output, result, _ = tiny_probe
    assert rc == 0, output[-3000:]
    check_consistent(result, 16, 4, 48)
    assert "correct" in output and "reward std" in output  # the histogram table came first
    print(json.dumps(result))


@pytest.mark.slow  # a probe run (~17 s); test_run_outputs.py's --preflight test runs this probe with a never-earned
# reward fast: its stop needs zero_var_frac 1, and it prints this verdict ("0 of 16 prompts earned any reward: ...")
def test_a_reward_never_earned_gives_no_signal(tmp_path):
    reward_file = tmp_path / "never_reward.py"
    reward_file.write_text(NEVER_REWARD)
    rc, output, result = run_probe("--n", "16", "--num_generations", "4", "--reward_file", str(reward_file),
                                   "--reward_funcs", "never", "--reward_weights", "1")
    assert rc == 0, output[-3000:]
    check_consistent(result, 16, 4, 48)
    assert result["zero_var_frac"] == 1.0
    assert "no signal" in result["verdict"] and "0 of 16 prompts earned any reward" in result["verdict"]


def test_logged_completions_follow_the_viewers_format(tiny_probe):
    rc, output, result, path = tiny_probe
    assert rc == 0, output[-3000:]
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 8 and {r["step"] for r in rows} == {7}
    for row in rows:
        assert len(row["tokens"]) == len(row["logps"]) == len(row["sampler_logps"]) == len(row["ratio"]) > 0
        assert set(row["rewards"]) >= {"correctness", "format"}
        # fp32 on both sides: vLLM's log-probs are the trainer's
        assert max(abs(a - b) for a, b in zip(row["logps"], row["sampler_logps"])) < 1e-3


def test_a_missing_model_is_named():
    rc, output, _ = run_probe("--model", "models/no-such-model", "--n", "4", timeout=120)
    assert rc != 0 and "models/no-such-model" in output and "not found" in output


def test_a_missing_dataset_is_named():
    rc, output, _ = run_probe("--dataset", "data/no_such.jsonl", "--n", "4", timeout=120)
    assert rc != 0 and "data/no_such.jsonl" in output and "not found" in output


@pytest.mark.slow
def test_smollm2_probe_reports_its_figures(smollm2):  # noqa: F811
    rc, output, result = run_probe("--model", smollm2, "--n", "8", "--num_generations", "4",
                                   "--max_new_tokens", "32", timeout=900)
    assert rc == 0, output[-3000:]
    check_consistent(result, 8, 4, 32)
    save_figures("probe_smollm2", result)
    # what the untouched model needs, in the verdict: a warm start (it never writes the answer tags), and room
    # (it writes ~150 tokens; at 32 most completions are cut off)
    assert result["verdict"].startswith("0 of 8 prompts earned any reward") and "tools/warm_start.py" in result["verdict"]
    assert result["truncated_frac"] >= 0.5 and "raise --max_new_tokens" in result["verdict"]


def test_the_verdict_names_what_is_wrong():
    import torch
    from simple_grpo.run.probe import verdict
    assert verdict([16, 0, 0, 0, 0], torch.zeros(64), 1.0, 0.0, 4).startswith("0 of 16 prompts earned any reward")
    assert "no group has reward variance" in verdict([16, 0, 0, 0, 0], torch.ones(64), 1.0, 0.0, 4)
    assert verdict([10, 2, 0, 0, 4], torch.rand(64), 0.75, 0.0, 4).startswith("most groups (75%) are all-alike")
    assert verdict([2, 5, 6, 3, 0], torch.rand(64), 0.1, 0.0, 4) == "healthy: 90% of groups have reward variance"
    assert "hit --max_new_tokens" in verdict([2, 5, 6, 3, 0], torch.rand(64), 0.1, 0.9, 4)
