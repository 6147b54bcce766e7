import os
import shutil
import sys
import tempfile

import pytest

# tests import the project's modules (simple_grpo.*, grpo_math, evaluate, tools.*) from the repo root
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    """Each pytest process keeps its runs in a folder of its own, runs/pytest-PID-XXXX/, removed when the process
    ends: $SIMPLE_GRPO_RUNS names it, every process a test starts inherits it, and the trainers and tools put
    RUN_NAME/ there (simple_grpo/run/checkpoints.py's runs_root). So `make test` and a `pytest tests/one_file.py`
    beside it in one checkout, or two xdist workers, never share nor delete each other's run directories. The
    tests still start their processes in the repository root, where models/ and data/ are."""
    from simple_grpo.run.checkpoints import RUNS_ENV
    os.makedirs(os.path.join(ROOT, "runs"), exist_ok=True)
    os.environ[RUNS_ENV] = tempfile.mkdtemp(prefix=f"pytest-{os.getpid()}-", dir=os.path.join(ROOT, "runs"))


def pytest_unconfigure(config):
    from simple_grpo.run.checkpoints import RUNS_ENV
    runs = os.environ.pop(RUNS_ENV, None)
    if runs:
        shutil.rmtree(runs, ignore_errors=True)


@pytest.fixture(autouse=True)
def fresh_deepspeed_world_group():
    """Many engines in one process, as only the tests make them: DeepSpeed clones torch's world group at a
    process's first engine (deepspeed.utils.groups._WORLD_GROUP) and reuses the clone for every later one. A
    test that destroys the process group (vLLM's clean-up, leave_process_group) leaves the clone naming a group
    torch no longer knows, and the next engine fails ("Group ... is not registered"). After each test, a
    destroyed group's clone is forgotten, so the next engine clones the world group of now. A run is one
    process and one engine, so the trainers leave DeepSpeed's state alone."""
    yield
    forget_destroyed_world_group()


def forget_destroyed_world_group():
    groups = sys.modules.get("deepspeed.utils.groups")  # only where a test has imported DeepSpeed
    if groups is not None and groups._WORLD_GROUP is not None:
        from torch.distributed import distributed_c10d
        if groups._WORLD_GROUP not in distributed_c10d._world.pg_map:
            groups._WORLD_GROUP = None


GPU_SUMMARY = pytest.StashKey()  # lines tests/test_gpu.py adds, printed once at the end of the session


@pytest.fixture(scope="session")
def shared_ref_server():
    """One live ref server (the tiny model, on loopback) for every module whose runs need one (they import
    tests/test_ref_server.py's `server`): started once, not once a module. Each run takes only its own run_id's
    groups, so one run's leftovers (a killed trainer's) do not reach another."""
    from tools.launch import free_port, start_ref_server
    port = free_port()
    proc = start_ref_server(port, dict(os.environ))  # the demo's own start-up: waits for /health
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture
def gpu_summary(request):
    """A function that adds a line to the GPU summary (`make test-gpu` prints it at the end)."""
    return request.config.stash.setdefault(GPU_SUMMARY, []).append


def pytest_terminal_summary(terminalreporter, config):
    lines = config.stash.get(GPU_SUMMARY, [])
    if lines:
        terminalreporter.section("GPU summary")
        for line in lines:
            terminalreporter.write_line(line)


def pytest_sessionfinish(session, exitstatus):
    """`make test-gpu` (-m gpu) where CUDA is absent: tests/test_gpu.py skips whole with its reason, nothing is
    left to run, and pytest would exit 5 ("no tests collected"); that is the expected outcome here: exit 0."""
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and session.config.getoption("markexpr") == "gpu":
        import torch
        if not torch.cuda.is_available():
            session.exitstatus = pytest.ExitCode.OK
