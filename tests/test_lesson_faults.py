"""The lesson's safeguards, live: a dead generation process or ref server stops the run naming it, a killed
trainer leaves no vLLM process behind, a bad data file or run directory is refused before anything starts."""
import os
import signal
import subprocess
import sys

import psutil
import pytest

from tests.test_faults import fresh, metrics, wait_for
from tools.launch import ROOT, free_port, start_ref_server, stop

LESSON = [sys.executable, "grpo_vllm_one.py", "--batch_prompts", "4", "--steps", "100"]


def lesson_run(run, ref_url, *flags):
    return subprocess.Popen([*LESSON, "--ref_url", ref_url, "--run_name", fresh(run), *flags], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def vllm_process(trainer):
    """The trainer's generation process (multiprocessing's spawned child)."""
    return next(p for p in psutil.Process(trainer.pid).children(recursive=True)
                if "spawn_main" in " ".join(p.cmdline()))


@pytest.mark.slow  # ~1-2 min: two lesson runs start vLLM
def test_a_dead_vllm_process_stops_the_run_naming_it_and_a_killed_trainer_leaves_none():
    port = free_port()
    server = start_ref_server(port, os.environ, stdout=subprocess.DEVNULL)
    try:
        trainer = lesson_run("test_lesson_vllm_dies", f"http://127.0.0.1:{port}")
        try:
            wait_for(lambda: len(metrics("test_lesson_vllm_dies")) >= 1, 400, trainer)
            vllm = vllm_process(trainer)
            vllm.kill()
            assert trainer.wait(timeout=120) != 0
            assert "the generation process (vLLM) died" in trainer.stderr.read()
        finally:
            trainer.kill()
        trainer = lesson_run("test_lesson_trainer_killed", f"http://127.0.0.1:{port}")
        try:
            wait_for(lambda: len(metrics("test_lesson_trainer_killed")) >= 1, 400, trainer)
            vllm = vllm_process(trainer)
            trainer.send_signal(signal.SIGKILL)  # no clean-up at all: the vLLM process sees its parent gone
            _, alive = psutil.wait_procs([vllm], timeout=30)
            assert not alive
        finally:
            trainer.kill()
    finally:
        stop(server)


@pytest.mark.slow  # ~1 min
def test_a_dead_ref_server_stops_the_run_naming_it():
    port = free_port()
    server = start_ref_server(port, os.environ, stdout=subprocess.DEVNULL)
    trainer = lesson_run("test_lesson_server_dies", f"http://127.0.0.1:{port}", "--peer_timeout", "5")
    try:
        wait_for(lambda: len(metrics("test_lesson_server_dies")) >= 1, 400, trainer)
        stop(server)
        assert trainer.wait(timeout=120) != 0
        assert f"ref server at http://127.0.0.1:{port} has not answered for 5 s" in trainer.stderr.read()
        family = psutil.Process().children(recursive=True)
        assert not [p for p in family if "spawn_main" in " ".join(p.cmdline())]  # its vLLM process is gone too
    finally:
        trainer.kill()
        stop(server)


def test_a_bad_data_file_and_a_used_run_directory_are_refused_before_anything_starts(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1 + 1?", "answer": "2"}\n')  # no '#### N' line
    out = subprocess.run([*LESSON, "--dataset", str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "row 1's answer has no '#### N' line" in out.stderr, out.stderr[-2000:]
    out = subprocess.run([*LESSON, "--dataset", str(tmp_path / "none.jsonl")], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "none.jsonl" in out.stderr and "FileNotFoundError" in out.stderr
    run = fresh("test_lesson_used_dir")
    os.makedirs(os.path.join(runs_dir(), run))
    open(os.path.join(runs_dir(), run, "metrics.jsonl"), "w").write("{}\n")
    out = subprocess.run([*LESSON, "--run_name", run], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "holds an earlier run: --overwrite replaces it" in out.stderr
    assert os.path.exists(os.path.join(runs_dir(), run, "metrics.jsonl"))  # never deleted unasked


def runs_dir():
    from simple_grpo.run.checkpoints import runs_root
    return os.path.join(ROOT, runs_root())
