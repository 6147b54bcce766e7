"""The policy trains in training mode: from_pretrained leaves a model in evaluation mode, where transformers
skips gradient checkpointing and dropout does nothing, so both trainers switch modes themselves. Checked
with real DeepSpeed engines on the tiny model: the mode of every forward, the activations the backward
keeps with and without --gradient_checkpointing, dropout under --disable_dropout, and whole runs of both
trainers calling torch's checkpoint."""
import json
import os
import subprocess
import sys

import pytest

from simple_grpo.run.checkpoints import runs_root
from tools.launch import TRAINER_ARGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LORA = ["--use_peft", "--lora_target_modules", "all-linear"]
CONFIGS = {"plain": [], "checkpointed": ["--gradient_checkpointing"], "micro": ["--micro_batch_groups", "1"],
           "triton": ["--loss_impl", "triton"], "zero3": ["--zero_stage", "3"],
           "bf16": ["--zero_stage", "2", "--dtype", "bfloat16"], "lora": LORA, "lora_dropout": LORA + ["--lora_dropout", "0.3"],
           "lora_no_dropout": LORA + ["--disable_dropout"]}


@pytest.fixture(scope="module")
def steps():
    """One real update for each of CONFIGS (tests/training_mode_step.py), in one fresh process: {name: result}.
    TRITON_INTERPRET=1 lets --loss_impl triton run its kernels on the CPU; the torch path ignores it."""
    out = subprocess.run([sys.executable, "tests/training_mode_step.py", json.dumps(CONFIGS)], cwd=ROOT,
                         capture_output=True, text=True, timeout=900,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    results = {r["name"]: r for r in map(json.loads, [line for line in out.stdout.splitlines()
                                                         if line.startswith('{"name"')])}
    assert sorted(results) == sorted(CONFIGS)
    return results


def test_the_update_runs_in_training_mode_and_checkpointing_keeps_fewer_activations(steps):
    plain, checkpointed = steps["plain"], steps["checkpointed"]
    print(f"bytes saved for backward: {plain['saved_bytes']:,} plain, {checkpointed['saved_bytes']:,} checkpointed")
    for run in (plain, checkpointed):
        assert run["started_training"] is False  # as from_pretrained leaves it
        assert run["update_modes"] and all(run["update_modes"])  # every forward of the update trains
    assert checkpointed["saved_bytes"] < plain["saved_bytes"] / 2
    # the same update: checkpointing recomputes, it does not change the numbers
    assert checkpointed["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    assert checkpointed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-4) and plain["grad_norm"] > 0


def test_the_lora_reference_runs_in_evaluation_mode_and_lora_dropout_acts_unless_disabled(steps):
    for name in ("lora", "lora_dropout", "lora_no_dropout"):
        run = steps[name]
        assert run["ref_modes"] and not any(run["ref_modes"])  # the reference: no dropout, as the ref server
        assert run["update_modes"] and all(run["update_modes"])
    # LoRA's dropout (TRL's 0.05 by default) draws new masks at each training-mode forward; more at 0.3
    assert 1e-4 < steps["lora"]["repeat_gap"] < steps["lora_dropout"]["repeat_gap"]
    assert steps["lora_no_dropout"]["repeat_gap"] == 0.0  # --disable_dropout: training mode computes one answer


def test_micro_batch_groups_splits_the_forward_and_gives_the_same_step(steps):
    whole, micro = steps["plain"], steps["micro"]
    # the shared-prompt forward: the Q prompts, then their Q*G completions; Q=2 groups of G=4, one group a pass
    assert whole["update_rows"] == [2, 8] and micro["update_rows"] == [1, 4, 1, 4]
    assert micro["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    assert micro["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-4)


def test_loss_impl_triton_runs_the_kernels_with_the_same_numbers(steps):
    torch_run, triton_run = steps["plain"], steps["triton"]
    assert torch_run["triton_calls"] == 0 and triton_run["triton_calls"] >= 1
    assert triton_run["loss"] == pytest.approx(torch_run["loss"], rel=1e-4)
    assert triton_run["grad_norm"] == pytest.approx(torch_run["grad_norm"], rel=1e-3)


def test_zero_stage_and_dtype_change_the_engine_they_name(steps):
    fp32, zero3, bf16 = steps["plain"], steps["zero3"], steps["bf16"]
    print({name: {k: r[k] for k in ("zero_stage", "param_dtype", "partitioned", "optimizer", "saved_bytes", "loss")}
           for name, r in (("fp32", fp32), ("zero3", zero3), ("bf16", bf16))})
    assert (fp32["zero_stage"], fp32["partitioned"], fp32["param_dtype"]) == (0, False, "torch.float32")
    assert (zero3["zero_stage"], zero3["partitioned"]) == (3, True)  # the weights live as shards
    assert zero3["loss"] == pytest.approx(fp32["loss"], rel=1e-5)
    assert (fp32["optimizer"], zero3["optimizer"]) == ("AdamW", "DeepSpeedZeroOptimizer_Stage3")
    assert (bf16["zero_stage"], bf16["param_dtype"], bf16["optimizer"]) == (2, "torch.bfloat16", "DeepSpeedZeroOptimizer")
    assert bf16["saved_bytes"] < 0.75 * fp32["saved_bytes"]  # bf16 activations: about half the bytes
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=0.05) and bf16["loss"] != fp32["loss"]


def test_lora_dropout_is_refused_while_dropout_is_disabled():
    out = subprocess.run([sys.executable, "-m", "simple_grpo.train", "--use_peft", "--disable_dropout", "--lora_dropout",
                          "0.05", "--steps", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "--lora_dropout 0.05 does nothing while --disable_dropout holds every dropout at 0" in out.stdout + out.stderr


# Counts torch's checkpoint calls in a whole trainer run: transformers binds the function when it is first
# imported, so this wraps it before anything else runs (a sitecustomize module), and every process of the
# run prints its count at exit. The real function still runs.
COUNTER = r"""
import atexit, os, sys
import torch.utils.checkpoint as checkpointing
calls = [0]
real = checkpointing.checkpoint
def counted(*args, **kwargs):
    calls[0] += 1
    return real(*args, **kwargs)
checkpointing.checkpoint = counted
def write():
    with open(os.path.join(os.path.dirname(__file__), f"calls.{os.getpid()}"), "w") as f:
        f.write(str(calls[0]))
atexit.register(write)
"""


# the full trainer's update is grpo_update, which the fast tests above run; its whole run (~35 s) is slow-marked
@pytest.mark.parametrize("trainer", ["grpo_train", pytest.param("full", marks=pytest.mark.slow)])
def test_a_whole_run_with_gradient_checkpointing_checkpoints(tmp_path, trainer):
    (tmp_path / "sitecustomize.py").write_text(COUNTER)
    run = f"test_checkpointing_{trainer}"
    out = subprocess.run([sys.executable, *TRAINER_ARGS[trainer], "--beta", "0", "--gradient_checkpointing",
                          "--steps", "2", "--batch_prompts", "4", "--num_generations", "4", "--max_new_tokens", "24",
                          "--lr", "1e-4", "--threads", "1", "--save_every", "100", "--run_name", run, "--overwrite"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    counts = {path.name: int(path.read_text()) for path in tmp_path.glob("calls.*")}
    assert counts and max(counts.values()) > 0, counts  # the trainer's process checkpointed its layers
    rows = [json.loads(line) for line in open(os.path.join(runs_root(), run, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2]
