"""Each trainer leaves the process group DeepSpeed made before its process ends. One left open makes NCCL warn at
exit that it can leak resources, as an H100 showed for grpo_train.py (docs/gpu_notes.md); gloo, here, says
nothing, so a sitecustomize module asks torch at the process's exit whether a group is still open."""
import os
import subprocess
import sys

import pytest

from tools.launch import ROOT, TRAINER_ARGS

AT_EXIT = r"""
import atexit, os
def write():  # registered first, so it runs after every other exit handler
    import torch.distributed as dist
    with open(os.path.join(os.path.dirname(__file__), f"open.{os.getpid()}"), "w") as f:
        f.write(str(dist.is_available() and dist.is_initialized()))
atexit.register(write)
"""


@pytest.mark.parametrize("trainer", ["grpo_train", pytest.param("full", marks=pytest.mark.slow)])
def test_a_finished_run_leaves_no_process_group_open(tmp_path, trainer):
    (tmp_path / "sitecustomize.py").write_text(AT_EXIT)
    out = subprocess.run([sys.executable, *TRAINER_ARGS[trainer], "--beta", "0", "--steps", "1", "--batch_prompts", "2",
                          "--num_generations", "4", "--max_new_tokens", "16", "--lr", "1e-4", "--threads", "1",
                          "--save_every", "100", "--run_name", f"test_process_group_{trainer}", "--overwrite"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    reports = list(tmp_path.glob("open.*"))  # one per process of the run
    assert reports, "no process of the run reported at exit"
    left_open = {path.name: path.read_text() for path in reports if path.read_text() == "True"}
    assert not left_open, f"processes that exited with a process group open: {left_open}"


SECOND_ENGINE = """
import sys, torch
sys.path.insert(0, "tests")
from conftest import forget_destroyed_world_group
from simple_grpo.train import Config
from simple_grpo.trainer.config import check_options
from simple_grpo.trainer.deepspeed_engine import make_engine
cfg = Config(beta=0.0, threads=1)
check_options(cfg)
make_engine(cfg)
torch.distributed.destroy_process_group()  # as a run's leave_process_group, or vLLM's clean-up, does
try:
    make_engine(cfg)
    print("second engine made without the reset")
except Exception as e:
    print("second engine failed:", e)
forget_destroyed_world_group()  # what conftest's fixture does after each test
engine, _ = make_engine(cfg)
print("engine after the reset:", engine.world_size)
"""


def test_the_suite_makes_a_second_engine_in_one_process_after_the_group_was_destroyed():
    """A run is one process and one engine; the suite makes many in one process. DeepSpeed keeps a clone of the
    first engine's world group, and once the group is destroyed (vLLM's clean-up, leave_process_group) the next
    engine fails ("Group ... is not registered") until conftest's fixture forgets the clone, after each test.
    In a process of its own: destroying the group in the suite's process would break its in-process vLLM tests."""
    out = subprocess.run([sys.executable, "-c", SECOND_ENGINE], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "second engine failed:" in out.stdout and "not registered" in out.stdout, out.stdout[-2000:]
    assert "engine after the reset: 1" in out.stdout, out.stdout[-2000:]
