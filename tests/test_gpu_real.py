"""tools/gpu_real.py in its tiny CPU form: the command that trains a real model on a GPU (SmolLM2's supervised
start, full fine-tuning in bf16) runs end to end on the tiny model: both evaluations, simple_grpo/train.py, the paired
gain, seconds a step and the sampler gap in its report."""
import json
import os
import subprocess
import sys

import pytest

from simple_grpo.run.checkpoints import runs_root

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # ~2.5 min: two evaluations and a simple_grpo.train run, each starting vLLM
def test_the_gpu_real_model_command_runs_in_its_tiny_form():
    cmd = [sys.executable, "tools/gpu_real.py", "--start", "models/tiny-math", "--system_prompt", "", "--n", "16",
           "--steps", "2", "--dtype", "float32", "--run_name", "test_gpu_real", "--",
           "--batch_prompts", "2", "--num_generations", "4", "--max_new_tokens", "16"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report == json.load(open(os.path.join(runs_root(), "test_gpu_real", "report.json")))
    assert report["steps"] == 2 and report["start"]["n"] == report["after"]["n"] == 16
    assert report["gain"]["ci95"][0] <= report["gain"]["points"] <= report["gain"]["ci95"][1]
    assert report["s_per_step"] > 0 and 0 <= report["sampler_gap_mean"] <= report["sampler_gap_max"] < 0.1
    assert "--dtype" in report["trainer_flags"] and "--use_peft" not in report["trainer_flags"]  # full fine-tuning
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert report["commit"] == report["tree"]["commit"] == head and len(report["tree"]["tree_sha256"]) == 64
    assert "GRPO - start:" in out.stdout


def test_a_child_past_its_minutes_is_stopped_and_says_so_one_within_them_is_not():
    """tools/gpu_real.py --minutes runs the trainer through launch.run_child with a time limit: past it the child
    is stopped (and run_child says the limit stopped it); a child that ends in time is waited for, and a failing
    one still stops the caller, naming it."""
    import time
    from tools.launch import child_env, run_child
    t0 = time.time()
    assert run_child(["-c", "import time; time.sleep(60)"], child_env(), "a sleeper", minutes=0.02) is True
    assert time.time() - t0 < 30  # stopped at its 1.2 s, not left to run its 60
    assert run_child(["-c", "pass"], child_env(), "a quick one", minutes=1) is False
    with pytest.raises(SystemExit, match="a failing one failed with exit code 3"):
        run_child(["-c", "raise SystemExit(3)"], child_env(), "a failing one", minutes=1)
