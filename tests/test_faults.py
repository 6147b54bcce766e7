"""Faults a long run meets, with the real trainers, DeepSpeed and ref server: a dead ref server (grpo_train.py),
kills during and between checkpoint saves, then --resume, and non-finite updates (the full trainer's)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from simple_grpo.run.checkpoints import runs_root
from tests.test_ref_server import server  # noqa: F401 - the live server fixture
from tools.launch import ROOT, free_port, start_ref_server

TRAIN = [sys.executable, "grpo_train.py", "--batch_prompts", "4", "--save_every", "2"]
FULL = [sys.executable, "-m", "simple_grpo.train", "--batch_prompts", "4", "--save_every", "2"]  # --resume is its


def metrics(run):
    path = os.path.join(runs_root(), run, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def fresh(run):
    """No trace of an earlier run under this name (its files would satisfy the waits below)."""
    shutil.rmtree(os.path.join(runs_root(), run), ignore_errors=True)
    return run


def wait_for(condition, timeout, proc=None, poll=0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return True
        assert proc is None or proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(poll)
    raise AssertionError("timed out")


def test_the_trainer_stops_naming_a_ref_server_that_died():
    port = free_port()
    ref = start_ref_server(port, dict(os.environ))
    # --peer_timeout 8: above the ref server's 2 s long poll (/get); the retries after the kill are this test's wait
    trainer = subprocess.Popen(TRAIN + ["--ref_url", f"http://127.0.0.1:{port}", "--steps", "100", "--peer_timeout", "8",
                                        "--run_name", fresh("test_ref_dies")], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(metrics("test_ref_dies")) >= 1, 300, trainer)
        ref.kill()
        killed = time.time()
        _, err = trainer.communicate(timeout=90)
        took = time.time() - killed
        assert trainer.returncode != 0
        assert took < 60, took
        assert f"ref server at http://127.0.0.1:{port} has not answered" in err, err[-2000:]
        print(f"trainer exited {took:.1f} s after the ref server was killed")
    finally:
        trainer.kill()
        ref.kill()


def kill_during_save(proc, run_dir, step):
    """SIGKILL proc while step_N.tmp/ exists (it is frozen first, so the save cannot finish in between).
    Returns True if caught mid-save, False if the save was already complete."""
    tmp = os.path.join(run_dir, f"step_{step}.tmp")
    wait_for(lambda: os.path.isdir(tmp) or os.path.isdir(tmp[:-4]), 300, proc, poll=0.002)
    proc.send_signal(signal.SIGSTOP)
    caught = os.path.isdir(tmp)
    proc.kill()
    proc.wait(timeout=30)
    return caught


def test_kills_during_and_between_saves_then_resume_continue_the_same_run(server):  # noqa: F811
    """The full trainer (grpo_train.py has no --resume). Its steps before the checkpoint a resume starts from are
    the run without faults, figure for figure; the steps after it train from the checkpoint's weights (policy lag
    0), on new samples: vLLM's sampler starts afresh with the new process, so they are not the same draws."""
    common = ["--ref_url", server, "--steps", "6", "--seed", "3"]
    # the run as it would be without faults
    out = subprocess.run(FULL + common + ["--run_name", "test_resume_ref"], cwd=ROOT, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    reference = metrics("test_resume_ref")

    run, run_dir = fresh("test_resume"), os.path.join(runs_root(), "test_resume")
    start = lambda *extra: subprocess.Popen(FULL + common + ["--run_name", run, *extra], cwd=ROOT,  # noqa: E731
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # 1. killed while it writes step_4 (step_2 is complete by then)
    proc = start()
    caught = kill_during_save(proc, run_dir, 4)
    if caught:
        assert os.path.isdir(os.path.join(run_dir, "step_4.tmp")) and not os.path.isdir(os.path.join(run_dir, "step_4"))
    # 2. resumed; killed between saves, after step 5 was logged
    proc = start("--resume")
    wait_for(lambda: any(r["step"] == 5 for r in metrics(run)), 300, proc)
    proc.kill()
    out_2 = proc.communicate(timeout=30)[0]
    assert ("resuming after step 2" if caught else "resuming after step 4") in out_2
    assert not os.path.exists(os.path.join(run_dir, "step_4.tmp"))
    # 3. resumed again: from step 4 to the end
    out = subprocess.run(FULL + common + ["--run_name", run, "--resume"], cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming after step 4" in out.stdout

    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    # the steps up to the first resume's checkpoint are the run without faults: the same rewards and losses
    before_resume = 2 if caught else 4
    for got, want in zip(rows[:before_resume], reference):
        assert got["reward_mean"] == want["reward_mean"] and abs(got["loss"] - want["loss"]) < 1e-5, (got, want)
    # the step after each resume trains on rollouts of the checkpoint's weights
    assert rows[before_resume]["policy_lag"] == 0 and rows[4]["policy_lag"] == 0
    assert sorted(os.listdir(run_dir)) == sorted(["config.json", "metrics.jsonl", "curves.png",
                                                  "step_2", "step_4", "step_6"])
    for step in (2, 4, 6):
        assert os.path.exists(os.path.join(run_dir, f"step_{step}", "model.safetensors"))
    assert os.path.isdir(os.path.join(run_dir, "step_6", "deepspeed"))  # only the latest keeps the optimizer
    assert not os.path.isdir(os.path.join(run_dir, "step_4", "deepspeed"))
    print(f"killed mid-save: {caught}")


def test_resume_without_a_checkpoint_says_so(server, tmp_path):  # noqa: F811
    out = subprocess.run(FULL + ["--ref_url", server, "--run_name", fresh("test_resume_none"), "--resume"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode != 0 and "no checkpoint to resume from" in out.stderr


NONFINITE = r"""
import json, sys, torch
from simple_grpo.trainer.deepspeed_engine import make_engine
from simple_grpo.train import Config
from simple_grpo.trainer.update import grpo_update
from grpo_math import completion_mask
results = {}
for stage in sys.argv[1:]:  # one engine per ZeRO stage, in turn in this process
    cfg = Config(zero_stage=int(stage), threads=1, lr=1e-6)
    engine, tok = make_engine(cfg)
    g = torch.Generator().manual_seed(0)
    batch = {"prompt_ids": torch.randint(3, 500, (2, 6), generator=g),
             "prompt_mask": torch.ones(2, 6, dtype=torch.long),
             "completion_ids": torch.randint(3, 500, (8, 5), generator=g), "advantages": torch.randn(8, generator=g),
             "ref_logps": -torch.rand(8, 5, generator=g)}
    batch["loss_mask"] = completion_mask(batch["completion_ids"], tok.eos_token_id)
    weights = lambda: torch.cat([p.detach().flatten().clone() for p in engine.module.parameters()])
    out, before = {}, weights()
    bad = dict(batch, ref_logps=batch["ref_logps"].clone())
    bad["ref_logps"][0, 0] = float("inf")                    # the loss is not finite
    out["loss"] = grpo_update(engine, bad, cfg)[0]["skipped_updates"]
    out["loss_unchanged"] = bool(torch.equal(weights(), before))
    param = next(engine.module.parameters())
    hook = param.register_hook(lambda grad: grad * float("nan"))  # the loss is finite, a gradient is not
    out["grad"] = grpo_update(engine, batch, cfg)[0]["skipped_updates"]
    out["grad_unchanged"] = bool(torch.equal(weights(), before))
    hook.remove()
    out["clean"] = grpo_update(engine, batch, cfg)[0]["skipped_updates"]
    after = weights()
    out["clean_changed"] = bool(not torch.equal(after, before)) and bool(torch.isfinite(after).all())
    results[stage] = out
print(json.dumps(results))
"""


def test_a_non_finite_loss_or_gradient_skips_the_update_and_leaves_the_weights():
    out = subprocess.run([sys.executable, "-c", NONFINITE, "0", "2"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert list(results) == ["0", "2"]
    for stage, result in results.items():
        assert result == {"loss": 1, "loss_unchanged": True, "grad": 1, "grad_unchanged": True,
                          "clean": 0, "clean_changed": True}, (stage, result)


# 2: a second SIGTERM while the trainer stops its worker (it also shows one SIGTERM's path; 1 is slow-marked)
@pytest.mark.parametrize("signals", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_sigterm_stops_the_trainer_and_every_process_it_started(server, signals):  # noqa: F811
    run = fresh(f"test_sigterm_{signals}")
    trainer = subprocess.Popen([sys.executable, "-m", "simple_grpo.train", "--ref_url", server, "--steps", "100",
                                "--run_name", run, "--batch_prompts", "4"], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(metrics(run)) >= 1 and metrics(run)[0].get("wait_s") is not None, 400, trainer)
        children = psutil.Process(trainer.pid).children(recursive=True)
        assert children  # the generation worker (and its helpers)
        for _ in range(signals):
            trainer.send_signal(signal.SIGTERM)
            time.sleep(0.5)
        trainer.wait(timeout=30 if signals == 2 else 60)
        assert trainer.returncode != 0
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, [p.pid for p in alive]
    finally:
        trainer.kill()


@pytest.mark.slow
def test_sigterm_to_make_demo_stops_server_trainer_and_worker():
    demo = subprocess.Popen([sys.executable, "tools/demo.py", "--steps", "100", "--run_name", fresh("test_demo_sigterm")],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(metrics("test_demo_sigterm")) >= 1, 400, demo)
        family = psutil.Process(demo.pid).children(recursive=True)
        assert len(family) >= 3  # ref server, trainer, generation worker
        demo.send_signal(signal.SIGTERM)
        demo.wait(timeout=90)
        assert demo.returncode != 0
        _, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:
        demo.kill()


def test_sigterm_while_the_demo_waits_for_the_ref_servers_health_leaves_no_server(tmp_path):
    """make demo's first wait (tools/launch.start_ref_server, up to 120 s): a SIGTERM then stops the server it
    started. The server here is a stand-in that never answers /health, so the signal comes during the wait."""
    mute = tmp_path / "mute_server.py"
    mute.write_text("import os, sys, time\nopen(sys.argv[-1] + '.pid', 'w').write(str(os.getpid()))\ntime.sleep(300)\n")
    waiter = subprocess.Popen([sys.executable, "-c", "import signal, sys\n"
                               "signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as tools/demo.py does\n"
                               "from tools.launch import start_ref_server\n"
                               f"start_ref_server({free_port()}, {{}}, str({str(tmp_path / 'mute')!r}), script={str(mute)!r})"],
                              cwd=ROOT, stderr=subprocess.PIPE, text=True)
    pid_file = tmp_path / "mute.pid"
    try:
        wait_for(lambda: pid_file.exists() and pid_file.read_text(), 60, waiter)
        server = psutil.Process(int(pid_file.read_text()))
        waiter.send_signal(signal.SIGTERM)
        assert waiter.wait(timeout=60) == 143, waiter.stderr.read()[-3000:]
        _, alive = psutil.wait_procs([server], timeout=30)
        assert not alive, "the ref server outlived the demo that started it"
    finally:
        waiter.kill()


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_fresh_one_kept(tmp_path, capsys):
    """torch waits forever on the `lock` file of an ops build that was killed: setup removes it once it is
    older than any build, and leaves a fresh one (a build running now in another process) alone."""
    from simple_grpo.trainer.deepspeed_engine import clear_stale_build_locks
    stale, fresh = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "other_op" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir()
        lock.touch()
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    clear_stale_build_locks(str(tmp_path))
    assert not stale.exists() and fresh.exists()
    assert "removing" in capsys.readouterr().out
