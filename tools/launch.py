"""Starting this project's own processes from a tool, a bench or a test: the reference server in the background
(ready once its /health answers), evaluate.py on a checkpoint (cached for a model that does not change), a
script as a child process, a free port, SmolLM2's supervised start (tools/fetch_smollm2.py, then
tools/warm_start.py), a trainer's command by its name (TRAINER_ARGS). tools/demo.py, tools/demo_real.py,
tools/study_real.py, the benches and the tests use them; MODEL, TEST and TINY_WORLD_FLAGS are the tiny default
world's. A module the tools import, not a script; the package (simple_grpo/) starts no script.
"""
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import requests

from simple_grpo.run.checkpoints import checkpoint_dirs
from tools.smollm2_recipe import SYSTEM_PROMPT, WARM_START_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
MODEL, TEST = "models/tiny-math", "data/toy_math/test.jsonl"
# the tiny model's tuned learning rate (docs/tuning.md's grpo_train runs: 2e-4 did worse, 5e-4 collapsed), the
# trainers' default for it too: given here so that a demo's command line says it
TINY_WORLD_FLAGS = ["--lr", "1e-4"]
# the trainers the demos, benches and tests start by name: what follows `python` (deepspeed: --module for -m).
# full: every feature (simple_grpo/train.py); grpo_vllm_one: the lesson, its default step alone; grpo_train: simple
TRAINER_ARGS = {"full": ["-m", "simple_grpo.train"], "grpo_vllm_one": ["grpo_vllm_one.py"],
                "grpo_train": ["grpo_train.py"]}


def child_env():
    """The environment the demos, the study and the benches give the processes they start: busy processes
    share the cores, so OpenMP threads sleep rather than spin while they wait; the tokenizers stay
    single-threaded; output is unbuffered, so the lines of several processes come in order."""
    return dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")


def stop(proc, grace=30):
    """Ends a child process that is still running: SIGTERM, then SIGKILL after `grace` seconds."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ref_server(port, env, *args, token="", script="ref_server.py", stdout=None):
    """ref_server.py (or script) in the background (extra flags in args, a later --model wins), once its
    /health answers; its output goes to stdout (an open file; default: ours)."""
    proc = subprocess.Popen([sys.executable, script, "--model", MODEL, "--port", str(port),
                             "--threads", "2", *args], cwd=ROOT, env=env, stdout=stdout)
    deadline = time.time() + 120
    try:
        while time.time() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"{script} exited with code {proc.returncode} during start-up")
            try:
                requests.get(f"http://127.0.0.1:{port}/health", timeout=1,
                             headers={"Authorization": f"Bearer {token}"} if token else {}).raise_for_status()
                return proc
            except requests.RequestException:
                time.sleep(0.5)
        raise SystemExit(f"{script} did not answer /health within 120 s")
    except BaseException:  # no answer in time, Ctrl-C or SIGTERM while waiting: leave no server running
        stop(proc)
        raise


def smollm2_warm_start(env, flags=WARM_START_FLAGS):
    """SmolLM2-135M-Instruct fetched and converted (tools/fetch_smollm2.py), then given its supervised start with
    `flags` (tools/warm_start.py: by default the recipe's, to the dev plateau, the best checkpoint kept); both
    cached, the start in a directory named for its cache key (warm_start_dir). Returns (base, warm) directories,
    relative to the repository when inside it (the warm start's cache key holds the base's path)."""
    fetched = subprocess.run([sys.executable, "tools/fetch_smollm2.py"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             text=True)
    if fetched.returncode != 0:
        raise SystemExit(f"tools/fetch_smollm2.py failed with exit code {fetched.returncode} (`make smollm2` "
                         "installs what it needs)")
    base = fetched.stdout.strip().splitlines()[-1]  # it prints the model's directory last
    base = os.path.relpath(base, ROOT) if base.startswith(ROOT + os.sep) else base
    flags = ["--system_prompt", SYSTEM_PROMPT, *flags]
    warm = warm_start_dir(base, flags, env)
    proc = subprocess.run([sys.executable, "tools/warm_start.py", "--model", base, "--out", warm, *flags],
                          cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"tools/warm_start.py failed with exit code {proc.returncode}")
    return base, warm


def warm_start_dir(base, flags, env):
    """Where the start tools/warm_start.py makes from `base` with `flags` is cached: base-warm-KEY, KEY its cache key
    (tools/warm_start.py --print_key: a hash of every flag, of the code the start runs and of the data it reads), so a
    start made by other flags, code or data lives in another directory and is trained again, not reused."""
    proc = subprocess.run([sys.executable, "tools/warm_start.py", "--model", base, *flags, "--print_key"], cwd=ROOT,
                          env=env, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"tools/warm_start.py --print_key failed with exit code {proc.returncode}")
    return base.rstrip("/") + "-warm-" + proc.stdout.strip().splitlines()[-1]


def evaluate(model_dir, env, data=TEST, args=()):
    """Greedy evaluation by evaluate.py in a subprocess (extra flags in args): prints its table, returns
    its figures."""
    out = subprocess.run([sys.executable, "evaluate.py", "--model", model_dir, "--dataset", data, "--json", *args],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, check=True)
    table, last = out.stdout.rstrip().rsplit("\n", 1)
    print(table, flush=True)
    return json.loads(last)


def trained_checkpoint(run_dir):
    """(the last checkpoint a trainer saved in run_dir, its step): the steps actually trained, whatever --steps
    the trainer was given."""
    saved = checkpoint_dirs(run_dir) if os.path.isdir(run_dir) else []
    if not saved:
        raise SystemExit(f"{run_dir} holds no checkpoint step_N/: the trainer saved nothing to evaluate")
    return saved[-1], int(saved[-1].rsplit("_", 1)[1])


def git_commit(where=ROOT):
    """The commit checked out at `where` (git rev-parse HEAD), or None outside a git checkout or without git."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def cached_evaluate(name, model, start, env, eval_args, details):
    """evaluate() of a model that does not change with the seed (base, the start), cached in the start's
    directory: evals/eval_NAME_KEY.json (its figures) and .jsonl (its details, copied to `details`), KEY a hash of
    the model, the test data and the evaluation flags. Made once per start and flags; delete evals/ to redo it."""
    key = hashlib.sha256(json.dumps([model, TEST, list(eval_args)]).encode()).hexdigest()[:12]
    cache = os.path.join(ROOT, start, "evals", f"eval_{name}_{key}")
    if not os.path.isfile(cache + ".json"):  # written last: a cache without it is incomplete
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        figures = evaluate(model, env, TEST, [*eval_args, "--details", cache + ".jsonl"])
        with open(cache + ".json", "w") as f:
            json.dump(figures, f)
    else:
        with open(cache + ".json") as f:
            figures = json.load(f)
        print(f"{name}: the evaluation cached in {os.path.relpath(cache, ROOT)}.json, accuracy "
              f"{figures['accuracy']:.3f} (delete it to evaluate again)", flush=True)
    shutil.copyfile(cache + ".jsonl", details)
    return figures


def run_child(cmd, env, what, minutes=0):
    """A step of a demo or study (a script of this repository and its flags) as a child process, stopped with
    us; its failure stops the demo or study, naming `what`. With minutes > 0 it is stopped (SIGTERM) once that
    many minutes have passed; returns whether the time limit stopped it."""
    proc = subprocess.Popen([sys.executable, *cmd], cwd=ROOT, env=env)
    try:
        try:
            proc.wait(timeout=minutes * 60 if minutes > 0 else None)
        except subprocess.TimeoutExpired:
            print(f"{what}: {minutes} minutes are up: stopping it", flush=True)
            return True
        if proc.returncode != 0:
            raise SystemExit(f"{what} failed with exit code {proc.returncode}")
        return False
    finally:
        stop(proc)
