"""The run doctor (simple_grpo/run/doctor.py): each rule fires on a run built to trigger it, once,
names the cause, and --stop_on turns it into a stop; a healthy run (the tiny demo's own metrics)
stays quiet. The no-signal case end to end: a reward never earned, the message, the exit."""
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from simple_grpo.run.checkpoints import runs_root
from simple_grpo.run.doctor import RULES, RunDoctor, batch_summary, parse_stop_on
from simple_grpo.trainer.config import check_options
from simple_grpo.train import Config
from tests.test_ref_server import server  # noqa: F401 - the live server fixture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def healthy(step, **changes):
    """One step record of a healthy run (values of the tiny demo's), with changes."""
    record = {"step": step, "kl": 0.05, "entropy": 0.2, "truncated_frac": 0.0, "ratio_mean": 1.0, "ratio_min": 0.9,
              "ratio_max": 1.1, "sampler_gap_mean": 0.005, "sampler_gap_max": 0.3, "zero_var_frac": 0.1}
    return {**record, **changes}


def summary(rewards, G=4):
    r = torch.tensor(rewards, dtype=torch.float)
    has_signal = r.view(-1, G).std(1) > 0
    scores = [{"reward": x, "correctness": x, "format": 0.0} for x in rewards]
    return {**batch_summary(r, scores, ["<think>2+2=5</think>"] * len(rewards), has_signal), "posted": 0}


def doctor(tmp_path, **flags):
    cfg = Config(**flags)
    check_options(cfg)  # as the trainers hand it over: the defaults that depend on other flags filled in (the lr)
    return RunDoctor(cfg, str(tmp_path / "metrics.jsonl")), tmp_path / "metrics.jsonl"


def warnings_in(path):
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if "warning" in json.loads(line)]


def run_steps(d, records):
    fired = []
    for record in records:
        before = set(d.active)
        d.step(record)
        fired += sorted(d.active - before)
    return fired


def test_no_signal_fires_after_the_window_once_with_rewards_and_a_sample(tmp_path):
    d, path = doctor(tmp_path, doctor_window=3)
    for step in range(1, 3):
        assert d.batch(summary([0.0] * 8), step) is None
    assert warnings_in(path) == []  # 2 silent batches: within the window
    d.batch(summary([0.0] * 8), 3)
    d.batch(summary([0.0] * 8), 4)  # still silent: it spoke once
    (w,) = warnings_in(path)
    assert w["warning"] == "no_signal" and w["step"] == 3
    assert "Rewards seen: 0 x24" in w["message"] and "2+2=5" in w["message"] and "correctness 0" in w["message"]
    d.batch(summary([0.0, 1.0, 0.0, 0.0] * 2), 5)  # a group with signal clears it...
    for step in range(6, 9):
        d.batch(summary([1.0] * 8), step)  # ...and three all-correct batches start it again
    assert [w["step"] for w in warnings_in(path)] == [3, 8]


def test_kl_after_one_update_names_the_learning_rate(tmp_path):
    d, path = doctor(tmp_path, lr=1e-4)
    d.step(healthy(1, kl=239.0))
    (w,) = warnings_in(path)
    assert w["warning"] == "kl" and "KL 239 after 1 update" in w["message"] and "learning rate" in w["message"]


def test_the_learning_rate_advice_fits_full_training_or_lora(tmp_path):
    full, path = doctor(tmp_path / "full", lr=1e-4)
    (tmp_path / "full").mkdir()
    full.step(healthy(1, kl=239.0))
    assert "about 1e-6 in full" in warnings_in(path)[0]["message"]
    lora, path = doctor(tmp_path / "lora", lr=0.1, use_peft=True)
    (tmp_path / "lora").mkdir()
    lora.step(healthy(1, kl=80.0))
    message = warnings_in(path)[0]["message"]
    assert "--lr 0.1" in message and "LoRA adapters on a real pretrained model train at about 1e-4" in message


def test_kl_jump_fires_and_the_demos_spike_does_not(tmp_path):
    d, path = doctor(tmp_path)
    assert run_steps(d, [healthy(s, kl=0.1) for s in range(1, 20)] + [healthy(20, kl=1.3)]) == []  # 13x: the demo's
    assert run_steps(d, [healthy(s, kl=0.1) for s in range(21, 31)] + [healthy(31, kl=2.5)]) == ["kl"]  # 25x
    assert "jumped to 2.5 from a recent mean of 0.1" in warnings_in(path)[0]["message"]


def test_entropy_collapse(tmp_path):
    d, path = doctor(tmp_path, doctor_window=5)
    records = [healthy(s, entropy=0.5) for s in range(1, 11)] + [healthy(s, entropy=0.01) for s in range(11, 16)]
    assert run_steps(d, records) == ["entropy"]
    assert "collapsing" in warnings_in(path)[0]["message"]


def test_most_completions_cut_off(tmp_path):
    d, path = doctor(tmp_path, doctor_window=4, max_new_tokens=48)
    assert run_steps(d, [healthy(s, truncated_frac=0.9) for s in range(1, 6)]) == ["truncated"]
    assert "--max_new_tokens 48" in warnings_in(path)[0]["message"]


def test_completions_vllms_context_ended_are_named_at_once(tmp_path):
    """A completion vLLM ended at --max_model_len (context_cut_frac, the full trainer's) is a setting's doing, not the
    policy's: the truncated rule speaks at its first step, naming the context and each cause's share."""
    from simple_grpo.train import Config as VllmConfig
    d = RunDoctor(VllmConfig(doctor_window=4, max_new_tokens=48, max_model_len=150), str(tmp_path / "metrics.jsonl"))
    records = [healthy(1, truncated_frac=0.5, context_cut_frac=0.375)] + [healthy(s) for s in range(2, 4)]
    assert run_steps(d, records) == ["truncated"]
    message = warnings_in(tmp_path / "metrics.jsonl")[0]["message"]
    print(message)
    assert "50% of the completions of the last 1 step were cut off" in message
    assert "12% at --max_new_tokens 48" in message and "38% at the end of vLLM's context, --max_model_len 150" in message


def test_sampler_mismatch_and_ratio(tmp_path):
    d, path = doctor(tmp_path, doctor_window=3)
    assert run_steps(d, [healthy(s, sampler_gap_mean=0.4, sampler_gap_max=5.0) for s in range(1, 4)]) == ["mismatch"]
    (tmp_path / "ratio").mkdir()
    d, path = doctor(tmp_path / "ratio", doctor_window=3)
    assert run_steps(d, [healthy(s, ratio_mean=1.5, ratio_max=9.0) for s in range(1, 4)]) == ["ratio"]
    assert "max 9" in warnings_in(path)[0]["message"]


def test_tis_weights_at_the_cap_fire_over_a_window_naming_the_lags(tmp_path):
    """A stale run (--max_policy_lag 4) whose TIS weights sit at --tis_cap for most tokens: the weights have collapsed
    and no longer correct the staleness. Fewer than the window's steps, or a share under the limit, stay quiet."""
    d, path = doctor(tmp_path, doctor_window=3, max_policy_lag=4, tis_cap=2.0)
    stale = dict(is_weight_mean=1.8, is_weight_min=0.2, is_weight_max=2.0, policy_lag=3)
    records = [healthy(1, is_capped_frac=0.9, batch_lags=[1], **stale), healthy(2, is_capped_frac=0.9,
                                                                                 batch_lags=[4], **stale)]
    assert run_steps(d, records) == []  # within the window
    assert run_steps(d, [healthy(3, is_capped_frac=0.3, batch_lags=[3], **stale)]) == ["tis"]  # the mean: 70%
    (w,) = warnings_in(path)
    assert w["warning"] == "tis" and w["step"] == 3
    assert "70% of the tokens' TIS weights" in w["message"] and "--tis_cap 2" in w["message"]
    assert "policy lag mean 2.7, max 4" in w["message"] and "Lower --max_policy_lag" in w["message"]
    (tmp_path / "quiet").mkdir()
    d, path = doctor(tmp_path / "quiet", doctor_window=3)
    assert run_steps(d, [healthy(s, is_capped_frac=0.4, policy_lag=1) for s in range(1, 6)]) == []


def test_steps_without_an_update_fire_no_rule(tmp_path):
    """grpo_train.py logs kl, loss, grad_norm, ratio_mean and clip_fraction as None where no group had signal."""
    d, path = doctor(tmp_path, doctor_window=3)
    no_update = {"kl": None, "loss": None, "grad_norm": None, "ratio_mean": None, "clip_fraction": None}
    assert run_steps(d, [healthy(s, **no_update) for s in range(1, 5)]) == [] and warnings_in(path) == []


def test_steps_without_an_update_are_left_out_of_the_kl_mean(tmp_path):
    """KL 1.5 after 0.1 is a 15x jump, under --doctor_kl_jump 20; counted as KL 0, the steps with no update
    would halve the mean and make it 30x."""
    d, path = doctor(tmp_path)
    steps = [healthy(s, kl=0.1 if s % 2 else None) for s in range(1, 11)] + [healthy(11, kl=1.5)]
    assert run_steps(d, steps) == []


def test_stop_on_turns_a_rule_into_a_stop_and_rejects_unknown_names(tmp_path):
    d, _ = doctor(tmp_path, stop_on="kl,no_signal")
    stop = d.step(healthy(1, kl=50.0))
    assert stop.startswith("run doctor stopped the run (--stop_on kl): KL 50")
    with pytest.raises(SystemExit, match="unknown --stop_on rule"):
        parse_stop_on("kl,loss_is_zero")
    assert set(RULES) == {"no_signal", "kl", "entropy", "truncated", "mismatch", "ratio", "tis"}


def test_quiet_on_the_tiny_demos_healthy_metrics(tmp_path):
    """Every step of a make demo run (seed 0, 450 steps, 0.424 -> 0.536; the doctor's keys of its metrics.jsonl,
    committed as tests/data/demo_metrics.jsonl)."""
    d, path = doctor(tmp_path)
    rows = [json.loads(line) for line in open(os.path.join(ROOT, "tests", "data", "demo_metrics.jsonl"))]
    for row in rows:
        if "warning" not in row:
            d.step(row)
    assert len(rows) >= 400 and warnings_in(path) == []


def trainer(*flags, timeout=600):
    t0 = time.time()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}  # a vLLM in this process may set it
    out = subprocess.run([sys.executable, "-m", "simple_grpo.train", "--reward_file", "tests/never_rewards.py",
                          "--reward_funcs", "never", "--reward_weights", "1", "--batch_prompts", "4",
                          "--num_generations", "4", "--doctor_window", "4", "--steps", "3", *flags], cwd=ROOT,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return out, time.time() - t0


@pytest.fixture(scope="module")
def no_signal_stop():
    """simple_grpo/train.py with a reward never earned and --stop_on no_signal: its output (stdout and stderr)."""
    out, seconds = trainer("--beta", "0", "--stop_on", "no_signal", "--run_name", "test_no_signal_stop")
    return out, seconds


def test_no_signal_run_stops_with_the_doctors_message(no_signal_stop):
    """A reward never earned: the worker drops every batch; within 4 batches of vLLM's start the doctor
    says so, and --stop_on no_signal ends the run with a non-zero exit and the reason."""
    out, seconds = no_signal_stop
    assert out.returncode != 0, out.stdout[-3000:]
    assert "run doctor [no_signal]" in out.stdout and "Rewards seen: 0 x64" in out.stdout, out.stdout[-3000:]
    assert "run doctor stopped the run (--stop_on no_signal)" in out.stdout
    ready = float(out.stdout.split("vLLM ready after ")[1].split(" s")[0])
    print(f"no-signal stop: {seconds:.0f} s in all, vLLM start {ready:.0f} s")


def test_vllms_info_and_warning_lines_stay_out_of_a_trainers_output(no_signal_stop):
    """vLLM's log lines look like '(MainProcess pid=7) INFO 11-26 07:31:15 [model.py:733] ...'; its worker
    started vLLM (generation/vllm_sampler.py's quiet_vllm: VLLM_LOGGING_LEVEL=INFO would show them)."""
    out, _ = no_signal_stop
    assert "vLLM ready after " in out.stdout
    assert not re.search(r"\b(INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d \[", out.stdout), out.stdout[-3000:]


def test_config_json_holds_the_flags_as_resolved(no_signal_stop):
    """--lr, --epsilon_high and --scale_rewards left unset: runs/NAME/config.json holds the values the run used."""
    config = json.load(open(os.path.join(runs_root(), "test_no_signal_stop", "config.json")))
    assert (config["lr"], config["epsilon_high"], config["scale_rewards"]) == (1e-4, 0.2, "group")


@pytest.mark.slow  # ~45 s; the fast suite keeps the doctor's stop on the same run (above)
def test_no_signal_run_without_stop_on_ends_at_its_deadline(server):  # noqa: F811
    """The same run through the ref server (the wait that had no deadline): the doctor's warning, the
    progress bar saying what it waits for, and --data_timeout ending the run naming what never came."""
    out, seconds = trainer("--ref_url", server, "--data_timeout", "20", "--run_name", "test_no_signal_deadline")
    assert out.returncode != 0, out.stdout[-3000:]
    assert "run doctor [no_signal]" in out.stdout
    assert "waiting for step 1's batch" in out.stdout and "dropped whole (all groups all-alike)" in out.stdout
    assert "no trainable batch came in 20 s (--data_timeout): the worker's last" in out.stdout, out.stdout[-3000:]
    print(f"no-signal deadline: {seconds:.0f} s in all")
