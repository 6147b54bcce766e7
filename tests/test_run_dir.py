"""Nothing lost: a used runs/NAME/ is continued with --resume or replaced with --overwrite, and
otherwise the trainers refuse before loading anything; a disk that fills up during a save leaves the
last checkpoint whole, ends the run naming the disk and the step, and --resume continues once there
is room (a size-limited tmpfs the test mounts: a real full disk, as ENOSPC/short writes show)."""
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from simple_grpo.run.checkpoints import RUNS_ENV, check_run_dir, runs_root

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "models", "tiny-math")
TRAIN = os.path.join(ROOT, "data", "toy_math", "train.jsonl")
SMALL = ["--model", TINY, "--dataset", TRAIN, "--beta", "0", "--batch_prompts", "2", "--num_generations", "4",
         "--max_new_tokens", "16", "--lr", "1e-4"]


@dataclass
class RunFlags:
    run_name: str = "x"
    resume: bool = False
    overwrite: bool = False


def test_check_run_dir_refuses_a_used_directory_unless_told(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(RUNS_ENV, raising=False)  # the default: runs/ in the working directory
    check_run_dir(RunFlags())  # no runs/x/ at all
    os.makedirs("runs/x")
    open("runs/x/config.json", "w").write("{}")
    open("runs/x/metrics.jsonl", "w").close()
    check_run_dir(RunFlags())  # a run that stopped before its first step left nothing to lose
    with pytest.raises(SystemExit, match="no checkpoint to resume from in runs/x/"):
        check_run_dir(RunFlags(resume=True))
    os.makedirs("runs/x/step_5")
    for flags in (RunFlags(), RunFlags(run_name="x")):
        with pytest.raises(SystemExit) as e:
            check_run_dir(flags)
        assert "runs/x/" in str(e.value) and "--resume" in str(e.value) and "--overwrite" in str(e.value)
        assert "step_5" in str(e.value)
    check_run_dir(RunFlags(resume=True))
    check_run_dir(RunFlags(overwrite=True))
    with pytest.raises(SystemExit, match="give one of them"):
        check_run_dir(RunFlags(resume=True, overwrite=True))
    os.rename("runs/x/step_5", "runs/x/step_5.tmp")  # even a partial checkpoint marks a used directory
    with pytest.raises(SystemExit, match="--overwrite"):
        check_run_dir(RunFlags())
    os.rmdir("runs/x/step_5.tmp")
    open("runs/x/metrics.jsonl", "w").write('{"step": 1}\n')  # ... and so do logged steps
    with pytest.raises(SystemExit, match="metrics.jsonl"):
        check_run_dir(RunFlags())


def train(cwd, run, *flags, script="grpo_train.py", timeout=600):
    """The script (a path from the root, or -m and a module) in cwd, into cwd/runs/RUN_NAME/ (the default: the test
    suite's $SIMPLE_GRPO_RUNS left out)."""
    t0 = time.time()
    env = {k: v for k, v in os.environ.items() if k != RUNS_ENV}
    if script.startswith("-m "):  # run from cwd: the root on PYTHONPATH finds the package
        command, env["PYTHONPATH"] = script.split(), os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    else:
        command = [os.path.join(ROOT, script)]
    out = subprocess.run([sys.executable, *command, *SMALL, "--run_name", run, *flags], cwd=cwd,
                         env=env, capture_output=True, text=True, timeout=timeout)
    return out, time.time() - t0


def steps_logged(run_dir):
    return [json.loads(line)["step"] for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def test_a_repeated_command_is_refused_and_resume_or_overwrite_say_what_happens(tmp_path):
    """The full trainer's (--resume is its)."""
    run_dir, full = tmp_path / "runs" / "again", "-m simple_grpo.train"
    out, _ = train(tmp_path, "again", "--steps", "1", script=full)
    assert out.returncode == 0, out.stderr[-3000:]
    model = run_dir / "step_1" / "model.safetensors"
    before = (model.stat().st_mtime_ns, model.read_bytes())

    out, seconds = train(tmp_path, "again", "--steps", "1", script=full)  # the same command again
    assert out.returncode != 0
    message = out.stderr.strip().splitlines()[-1]
    assert "runs/again/" in message and "--resume" in message and "--overwrite" in message, message
    assert "Loading weights" not in out.stderr + out.stdout  # refused before the model loads
    assert (model.stat().st_mtime_ns, model.read_bytes()) == before and steps_logged(run_dir) == [1]

    out, _ = train(tmp_path, "again", "--steps", "2", "--resume", script=full)  # continued: step 2 after step 1
    assert out.returncode == 0, out.stderr[-3000:]
    assert steps_logged(run_dir) == [1, 2] and (run_dir / "step_2").is_dir()

    out, _ = train(tmp_path, "again", "--steps", "1", "--overwrite", script=full)  # replaced: a new run of one step
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("--overwrite: deleting step_") == 2
    assert steps_logged(run_dir) == [1] and sorted(p.name for p in run_dir.glob("step_*")) == ["step_1"]


def test_grpo_train_refuses_a_repeated_command_and_overwrite_replaces_the_run(tmp_path):
    run_dir = tmp_path / "runs" / "again"
    out, _ = train(tmp_path, "again", "--steps", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    model = run_dir / "step_2" / "model.safetensors"
    before = (model.stat().st_mtime_ns, model.read_bytes())

    out, seconds = train(tmp_path, "again", "--steps", "2")  # the same command again
    assert out.returncode != 0
    message = out.stderr.strip().splitlines()[-1]
    assert "runs/again/" in message and "--overwrite" in message and "--resume" in message, message
    assert "Loading weights" not in out.stderr + out.stdout  # refused before the model loads
    assert (model.stat().st_mtime_ns, model.read_bytes()) == before and steps_logged(run_dir) == [1, 2]

    out, _ = train(tmp_path, "again", "--steps", "1", "--overwrite")  # replaced: a new run of one step
    assert out.returncode == 0, out.stderr[-3000:]
    assert steps_logged(run_dir) == [1] and sorted(p.name for p in run_dir.glob("step_*")) == ["step_1"]


def test_the_full_trainer_refuses_before_starting_its_worker(tmp_path):
    os.makedirs(tmp_path / "runs" / "used" / "step_3")
    out, seconds = train(tmp_path, "used", script="-m simple_grpo.train", timeout=300)
    assert out.returncode != 0
    assert "runs/used/ holds an earlier run" in out.stderr and "--overwrite" in out.stderr
    assert "vLLM" not in out.stdout + out.stderr.replace("runs/used/", "")  # no worker was started
    assert (tmp_path / "runs" / "used" / "step_3").is_dir()


def test_a_second_pytest_process_in_this_checkout_deletes_none_of_this_ones_runs():
    """`pytest tests/one_file.py` while `make test` runs in the same checkout: each pytest process keeps its runs
    in a folder of its own, so the second one's start-up (tests/conftest.py) leaves the first one's runs alone."""
    held = os.path.join(runs_root(), "test_held")  # where a trainer this process starts puts --run_name test_held
    os.makedirs(os.path.join(held, "step_1"), exist_ok=True)
    open(os.path.join(held, "metrics.jsonl"), "w").write('{"step": 1}\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}  # not one of our xdist workers
    second = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "tests/test_run_dir.py::test_check_run_dir_refuses_a_used_directory_unless_told"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout[-3000:]
    assert steps_logged(held) == [1] and os.path.isdir(os.path.join(held, "step_1"))
    with pytest.raises(SystemExit, match=r"holds an earlier run \(1 checkpoint\(s\) up to step_1 and metrics.jsonl"):
        check_run_dir(RunFlags(run_name="test_held"))  # a trainer started now would still find the run, whole
    assert os.path.dirname(os.path.abspath(held)) != os.path.join(ROOT, "runs")  # a folder of this process's


@pytest.fixture
def small_disk(tmp_path):
    """runs/full/ on a 40 MB tmpfs: one tiny-model checkpoint with its optimizer state (~29 MB) fits,
    a second one does not. Needs root (mount)."""
    mount = tmp_path / "runs" / "full"
    mount.mkdir(parents=True)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({made.stderr.strip()}): the full-disk test needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_during_a_save_keeps_the_last_checkpoint_and_resume_continues(tmp_path, small_disk):
    """The full trainer's checkpoints (--resume is its)."""
    full = "-m simple_grpo.train"
    out, _ = train(tmp_path, "full", "--steps", "3", "--save_every", "1", script=full)
    assert out.returncode != 0
    message = out.stderr.strip().splitlines()[-1]
    assert message.startswith("no space left on the disk holding runs/full"), message
    assert str(small_disk) in message and "step 2 was not saved" in message, message
    assert "runs/full/step_1/ is whole" in message and "--resume" in message, message
    assert "Traceback" not in out.stderr
    # the last complete checkpoint is whole and loadable; the partial one is gone
    assert sorted(p.name for p in small_disk.iterdir() if p.name.startswith("step_")) == ["step_1"]
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(small_disk / "step_1")
    assert (small_disk / "step_1" / "deepspeed").is_dir()  # what --resume needs

    subprocess.run(["mount", "-o", "remount,size=100m", str(small_disk)], check=True)  # space is back
    out, _ = train(tmp_path, "full", "--steps", "3", "--save_every", "1", "--resume", script=full)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming after step 1" in out.stdout
    assert steps_logged(small_disk) == [1, 2, 3] and (small_disk / "step_3" / "model.safetensors").is_file()
