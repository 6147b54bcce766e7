"""The lesson's 60 steps of `make demo` against the full trainer's, both against one live ref server: every
sampled figure equal at every step, the update's figures within 1e-3 relative (slow: ~5 min)."""
import json
import os
import subprocess
import sys

import pytest

from simple_grpo.run.checkpoints import runs_root
from tests.test_ref_server import server  # noqa: F401 - fixture
from tools.launch import TINY_WORLD_FLAGS, child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLED = ("reward_mean", "reward_std", "accuracy", "format_rate", "completion_len", "truncated_frac",
           "zero_var_frac", "policy_lag")
UPDATE = ("loss", "kl", "grad_norm", "entropy")


def demo_run(command, server, name, steps):
    """`make demo`'s training command (tools/demo.py) for `steps` steps; its metrics.jsonl's step records."""
    flags = ["--ref_url", server, *TINY_WORLD_FLAGS, "--run_name", name, "--overwrite", "--seed", "0",
             "--steps", str(steps)]
    out = subprocess.run([sys.executable, *command, *flags], cwd=ROOT, env=child_env(), capture_output=True,
                         text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    with open(os.path.join(ROOT, runs_root(), name, "metrics.jsonl")) as f:
        return [row for row in map(json.loads, f) if "warning" not in row]


def first_difference(mine, theirs):
    """The first step and figure where the lesson's run is not the full trainer's, in words; None if none."""
    if len(mine) != len(theirs):
        return f"the lesson logged {len(mine)} steps, the full trainer {len(theirs)}"
    for a, b in zip(mine, theirs):
        for key in SAMPLED:
            if a[key] != b[key]:
                return f"step {a['step']}: {key} {a[key]} (lesson) != {b[key]} (full trainer)"
        for key in UPDATE:
            if abs(a[key] - b[key]) > max(1e-3 * abs(b[key]), 1e-6):
                return f"step {a['step']}: {key} {a[key]} (lesson) vs {b[key]} (full trainer), beyond 1e-3 relative"
    return None


@pytest.mark.slow
@pytest.mark.timeout(2400)  # two runs of ~3 min each on an idle machine, 10+ on a busy one
def test_60_demo_steps_of_the_lesson_are_the_full_trainers(server):  # noqa: F811
    steps = 60
    mine = demo_run(["grpo_vllm_one.py"], server, "lesson_60", steps)
    theirs = demo_run(["-m", "simple_grpo.train"], server, "full_60", steps)
    assert len(mine) == steps
    assert first_difference(mine, theirs) is None, first_difference(mine, theirs)


def test_first_difference_names_the_step_and_the_figure():
    row = {"step": 1, **{k: 0.5 for k in SAMPLED}, **{k: 1.0 for k in UPDATE}}
    assert first_difference([row], [row]) is None
    assert first_difference([row, {**row, "step": 2, "accuracy": 0.25}], [row, {**row, "step": 2}]) == \
        "step 2: accuracy 0.25 (lesson) != 0.5 (full trainer)"
    assert first_difference([{**row, "kl": 1.01}], [row]).startswith("step 1: kl 1.01 (lesson) vs 1.0")
    assert first_difference([{**row, "kl": 1.0005}], [row]) is None
