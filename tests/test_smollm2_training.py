"""Both trainers on a real pretrained model, SmolLM2-135M-Instruct, with a live ref server (slow).

    python -m pytest -q -m slow tests/test_smollm2_training.py

3 steps of each trainer in fp32 and in bf16 (grpo_train.py with its one reward; the full trainer with a reward
file that gives this model signal); 20 steps of the full trainer with every training default (only the model, the
rewards and the batch size set) keep the KL to the reference at most 0.1 per token: the default learning rate
(grpo_train.py's too) must not wreck a real model; and lr 1e-3 (KL 1.8 after 2 updates here; 1e-4 reached 0.3
after 3) is stopped by the run doctor (--stop_on kl) with the learning rate named.
"""
import os
import subprocess
import sys

import pytest

from simple_grpo.run.checkpoints import runs_root
from tests.test_smollm2 import save_figures, smollm2  # noqa: F401 - the converted model fixture
from tools.launch import TRAINER_ARGS, free_port, start_ref_server
from simple_grpo.run.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]  # bf16 steps take minutes on a CPU
SIGNAL = ["--reward_file", "tests/signal_rewards.py", "--reward_funcs", "mentions_answer,brevity",
          "--reward_weights", "1,0.5"]
SMALL = ["--batch_prompts", "2", "--num_generations", "4", "--max_new_tokens", "32"]


@pytest.fixture(scope="module")
def ref_server(smollm2):  # noqa: F811
    port = free_port()
    proc = start_ref_server(port, dict(os.environ), "--model", smollm2)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=30)


def train(trainer, run, model, server, *flags):
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, *TRAINER_ARGS[trainer], "--model", model, "--ref_url", server,
                          "--run_name", run, *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    steps, _ = read_metrics(os.path.join(runs_root(), run, "metrics.jsonl"))  # not the run doctor's warning rows
    return steps


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("trainer", ["grpo_train", "full"])
def test_three_steps_on_smollm2(trainer, dtype, smollm2, ref_server):  # noqa: F811
    rows = train(trainer, f"test_smollm2_{trainer}_{dtype}", smollm2, ref_server, "--steps", "3", "--dtype", dtype,
                 *SMALL, *(SIGNAL if trainer == "full" else []))  # --reward_file is the full trainer's
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["kl"] is None or r["kl"] <= 0.1 for r in rows)  # grpo_train.py: None where no group had signal
    if trainer == "full":  # vLLM's log-probs against the trainer's, measured every step
        assert all(0 <= r["sampler_gap_mean"] <= r["sampler_gap_max"] for r in rows)
    save_figures(f"three_steps_{trainer}_{dtype}", [{k: r.get(k) for k in (
        "step", "kl", "grad_norm", "step_s", "sampler_gap_mean", "sampler_gap_max", "is_weight_mean",
        "clip_fraction", "zero_var_frac")} for r in rows])


def test_twenty_steps_at_the_default_settings_keep_the_kl_under_a_tenth(smollm2, ref_server):  # noqa: F811
    rows = train("full", "test_smollm2_defaults", smollm2, ref_server, "--steps", "20", *SMALL, *SIGNAL)
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert sum(r["zero_var_frac"] < 1 for r in rows) >= 10  # the rewards gave signal: groups were trained
    assert max(r["kl"] for r in rows) <= 0.1
    save_figures("twenty_default_steps", {"kl_max": max(r["kl"] for r in rows), "kl_last": rows[-1]["kl"],
                                          "s_per_step": sum(r["step_s"] for r in rows[2:]) / len(rows[2:]),
                                          "steps_with_signal": sum(r["zero_var_frac"] < 1 for r in rows)})


def test_the_doctor_stops_a_learning_rate_that_wrecks_smollm2_and_names_it(smollm2, ref_server):  # noqa: F811
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, "-m", "simple_grpo.train", "--model", smollm2, "--ref_url", ref_server,
                          "--run_name", "test_smollm2_high_lr", "--overwrite", "--steps", "3", "--lr", "1e-3",
                          "--stop_on", "kl", *SMALL, *SIGNAL], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode != 0, out.stdout[-2000:]
    assert "run doctor stopped the run (--stop_on kl)" in out.stdout + out.stderr
    assert "--lr 0.001; a real pretrained model trains at about 1e-6 in full" in out.stdout + out.stderr
