"""What a run leaves behind and says: TRL-style metrics in metrics.jsonl, completions.jsonl every
--log_completions_every steps, curves.png at the end and report.html from them; the resolved flags in config.json;
null for the update's figures of a step with no update (grpo_train.py); --report_to's trackers, and --preflight
stopping a run that would get no signal, or whose probe outlives its deadline (the full trainer's). Short real runs
of both trainers (beta 0)."""
import contextlib
import json
import os
import subprocess
import sys

import psutil  # comes with vllm
import pytest

from simple_grpo.run.checkpoints import RUNS_ENV, runs_root
from tools.launch import TRAINER_ARGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRICS = ["entropy", "clip_low_frac", "clip_high_frac", "completion_len_min", "completion_len", "completion_len_max",
           "truncated_frac", "reward_correctness", "reward_correctness_std", "reward_format", "reward_format_std",
           "zero_var_frac", "ratio_min", "ratio_mean", "ratio_max", "lr", "tokens", "kl", "grad_norm"]
VLLM_METRICS = ["sampler_gap_mean", "sampler_gap_max", "is_weight_min", "is_weight_mean", "is_weight_max"]
# grpo_train.py's, as grpo_vllm_one.py's: the rewards' and the update's figures, not each reward function's
GRPO_TRAIN_METRICS = ["reward_mean", "reward_std", "accuracy", "format_rate", "completion_len", "truncated_frac",
                      "zero_var_frac", "tokens_per_s", "entropy", "clip_low_frac", "clip_high_frac", "ratio_min",
                      "ratio_mean", "ratio_max", "kl", "loss", "grad_norm"]


def run(trainer, name, *flags, timeout=900, env=None):
    return subprocess.run([sys.executable, *TRAINER_ARGS[trainer], "--beta", "0", "--lr", "1e-4", "--steps", "4",
                           "--batch_prompts", "4", "--run_name", name, "--log_completions_every", "2", *flags],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                          env=env)


@pytest.fixture(scope="module")
def no_signal_run(tmp_path_factory):
    """Two steps of grpo_train.py where no completion can earn a reward (one token each: no group has signal, no
    update is taken) and --lr left unset; its runs/ in a directory of its own. A process of its own: an
    in-process DeepSpeed run keeps a process group that a later test's in-process vLLM tears down, and the
    in-process runs after that (tests/test_trainer_options.py) would find it gone. Returns its run directory.
    (The full trainer samples again until a group has signal: tests/test_doctor.py's no-signal run.)"""
    where = tmp_path_factory.mktemp("no_signal")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "grpo_train.py"),
                           "--model", os.path.join(ROOT, "models", "tiny-math"),
                           "--dataset", os.path.join(ROOT, "data", "toy_math", "train.jsonl"),
                           "--beta", "0", "--steps", "2", "--batch_prompts", "2",
                           "--num_generations", "4", "--max_new_tokens", "1", "--run_name", "no_signal"],
                          cwd=where, env={k: v for k, v in os.environ.items() if k != RUNS_ENV},  # ./runs: the default
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:]
    return where / "runs" / "no_signal"


def test_a_step_with_no_signal_logs_null_for_what_no_update_measured(no_signal_run):
    rows = [json.loads(line) for line in open(no_signal_run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2] and all(r["zero_var_frac"] == 1.0 for r in rows)
    for r in rows:
        assert (r["kl"], r["loss"], r["grad_norm"], r["ratio_mean"], r["clip_fraction"]) == (None,) * 5


def test_config_json_holds_the_flags_as_resolved(no_signal_run):
    """grpo_train.py's lr (the full trainer's: tests/test_doctor.py's no-signal run)."""
    config = json.load(open(no_signal_run / "config.json"))
    assert config["lr"] == 1e-4


@pytest.mark.parametrize("trainer", ["grpo_train", "full"])
def test_a_run_logs_the_metrics_and_completions_its_report_shows(trainer):
    name = f"test_outputs_{trainer}"
    out = run(trainer, name, "--ref_url", "http://127.0.0.1:9")  # beta 0: no reference server, a closed port
    assert out.returncode == 0, out.stdout[-3000:]
    run_dir = os.path.join(runs_root(), name)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["zero_var_frac"] < 1 for r in rows)  # every step updated (seed 0), so every figure is there
    for key in (METRICS + VLLM_METRICS if trainer == "full" else GRPO_TRAIN_METRICS):
        assert all(key in r for r in rows), key
    for r in rows:
        assert 0 < r["entropy"] < 12 and 0 <= r["truncated_frac"] <= 1
        assert r["ratio_min"] <= r["ratio_mean"] <= r["ratio_max"] and r["kl"] == 0.0
        if trainer == "full":
            assert r["completion_len_min"] <= r["completion_len"] <= r["completion_len_max"]
            assert r["lr"] == 1e-4 and r["tokens"] > 0
    logged = [json.loads(line) for line in open(os.path.join(run_dir, "completions.jsonl"))]
    assert sorted({r["step"] for r in logged}) == [2, 4] and len(logged) == 2 * 8  # one group of G=8 each time
    for r in logged:
        assert r["prompt"] and r["completion"] is not None and "reward" in r and r["advantage"] is not None
        if trainer == "full":
            assert set(r["rewards"]) == {"correctness", "format"} and len(r["tokens"]) == len(r["logps"])
            assert r["sampler_logps"] is not None
    subprocess.run([sys.executable, "tools/view_run.py", run_dir], cwd=ROOT, check=True)  # the run's page
    page = open(os.path.join(run_dir, "report.html"), encoding="utf-8").read()
    assert "<h2>Completions</h2>" in page and "<h3>step 4 " in page and "<img class='curves'" in page
    if trainer == "full":  # it draws them at the end too
        assert os.path.getsize(os.path.join(run_dir, "curves.png")) > 1000


def test_report_to_a_missing_tracker_says_what_to_install():
    import importlib.util
    missing = [t for t in ("wandb", "tensorboard") if importlib.util.find_spec(t) is None]
    if not missing:
        pytest.skip("wandb and tensorboard are both installed here")
    out = run("full", "test_report_to_missing", "--report_to", missing[0], timeout=120)
    assert out.returncode != 0
    assert f"--report_to {missing[0]} needs the {missing[0]} package: pip install {missing[0]}" in out.stdout
    out = run("full", "test_report_to_bad", "--report_to", "mlflow", timeout=120)
    assert out.returncode != 0 and "unknown --report_to 'mlflow': use none, tensorboard or wandb" in out.stdout


def test_report_to_tensorboard_writes_the_steps():
    pytest.importorskip("tensorboard", reason="tensorboard is optional (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = run("full", "test_report_to_tensorboard", "--report_to", "tensorboard")
    assert out.returncode == 0, out.stdout[-3000:]
    events = EventAccumulator(os.path.join(runs_root(), "test_report_to_tensorboard", "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward_mean")] == [1, 2, 3, 4]
    assert "entropy" in events.Tags()["scalars"]


def test_preflight_stops_a_run_that_would_get_no_signal():
    out = run("full", "test_preflight", "--preflight", "--preflight_n", "16", "--reward_file",
              "tests/never_rewards.py", "--reward_funcs", "never", "--reward_weights", "1")
    assert out.returncode != 0, out.stdout[-3000:]
    assert '"pass_rate_hist"' in out.stdout  # the probe's own report and JSON line, shown
    assert ("pre-flight: 0 of 16 prompts earned any reward: GRPO will get no signal; warm-start the model "
            "on the answer format (supervised: python tools/warm_start.py --model MODEL --out DIR), or change the "
            "reward") in out.stdout
    assert "Not training (run without --preflight to train anyway)" in out.stdout
    assert not os.path.exists(os.path.join(runs_root(), "test_preflight", "metrics.jsonl"))


STALLS = """
import time

from simple_grpo.task.rewards import reward_function


@reward_function("stalls")
def stalls(completion, answer):
    time.sleep(3600)  # a probe that is not ended never finishes
    return 0.0
"""


def test_a_preflight_probe_past_its_deadline_stops_the_run_and_is_ended(tmp_path):
    (tmp_path / "stalls.py").write_text(STALLS)
    # a mark of this test's own in the run's environment, which the probe's process inherits: it is found by it
    mark = {"PREFLIGHT_TEST_MARK": str(tmp_path)}
    # the real probe takes longer than 1 s to start (torch, vLLM)
    out = run("full", "test_preflight_timeout", "--preflight", "--preflight_timeout", "1", "--reward_file",
              str(tmp_path / "stalls.py"), "--reward_funcs", "stalls", "--reward_weights", "1", timeout=300,
              env={**os.environ, **mark})
    assert out.returncode != 0, out.stdout[-3000:]
    assert ("pre-flight: the probe did not finish in 1 s (--preflight_timeout): it starts vLLM on "
            "models/tiny-math and samples 64 problems x 8 completions. Raise --preflight_timeout") in out.stdout
    left = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):  # gone meanwhile, or another user's
            if process.environ().get("PREFLIGHT_TEST_MARK") == mark["PREFLIGHT_TEST_MARK"]:
                left.append(process.pid)
    assert left == []
    assert not os.path.exists(os.path.join(runs_root(), "test_preflight_timeout", "metrics.jsonl"))
