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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One real update (grpo_update, grpo_vllm_one.py's) on a fixed batch, in a fresh process. It records the
# module's mode at every forward, and the bytes of every activation autograd saves for backward (weights
# left out: they are held anyway). Prints one JSON line.
STEP = r"""
import json, os, sys
import torch
sys.path.insert(0, os.getcwd())
from grpo_vllm_one import Config
from simple_grpo.flags import parse_flags
from simple_grpo.trainer.config import check_options
from simple_grpo.trainer.deepspeed_engine import make_engine
from simple_grpo.trainer.update import grpo_update, reference_logps

cfg = parse_flags(Config, "", sys.argv[1:] + ["--threads", "1", "--lr", "1e-4", "--beta", "0.04"])
check_options(cfg)
engine, tok = make_engine(cfg)
started_training = engine.module.training
modes = []
engine.module.register_forward_pre_hook(lambda module, args: modes.append(module.training))
g = torch.Generator().manual_seed(0)
Q, G, P, C = 2, 4, 24, 16
batch = {"prompt_ids": torch.randint(3, 500, (Q, P), generator=g), "prompt_mask": torch.ones(Q, P, dtype=torch.long),
         "completion_ids": torch.randint(3, 500, (Q * G, C), generator=g), "advantages": torch.randn(Q * G, generator=g)}
if cfg.use_peft:  # the reference: the base, adapters off
    batch["ref_logps"] = reference_logps(engine, batch, cfg)
else:  # a reference near the policy, as at the start of a run
    from simple_grpo.logprobs import sequence_logps
    with torch.no_grad():
        batch["ref_logps"] = sequence_logps(engine, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"])
    batch["ref_logps"] += 0.1 * torch.randn(Q * G, C, generator=g)
ref_modes, modes[:] = list(modes), []

params = {p.data_ptr() for p in engine.module.parameters()}
saved = {}
def pack(t):
    if t.data_ptr() not in params:  # an activation (a weight is kept whether or not backward needs it)
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return t
with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    stats, _ = grpo_update(engine, batch, cfg, tok.eos_token_id)

# two forwards of the same batch in training mode: equal unless dropout acts
from simple_grpo.logprobs import sequence_logps
with torch.no_grad():
    a, b = [sequence_logps(engine, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"]) for _ in "ab"]
print(json.dumps({"started_training": started_training, "ref_modes": ref_modes, "update_modes": modes,
                  "saved_bytes": sum(saved.values()), "loss": stats["loss"], "grad_norm": stats["grad_norm"],
                  "repeat_gap": (a - b).abs().max().item()}))
"""


def run_step(tmp_path, *flags):
    script = tmp_path / "step.py"
    script.write_text(STEP)
    out = subprocess.run([sys.executable, str(script), *flags], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads([line for line in out.stdout.splitlines() if line.startswith('{"started_training"')][-1])


def test_the_update_runs_in_training_mode_and_checkpointing_keeps_fewer_activations(tmp_path):
    plain = run_step(tmp_path)
    checkpointed = run_step(tmp_path, "--gradient_checkpointing")
    print(f"bytes saved for backward: {plain['saved_bytes']:,} plain, {checkpointed['saved_bytes']:,} checkpointed")
    for run in (plain, checkpointed):
        assert run["started_training"] is False  # as from_pretrained leaves it
        assert run["update_modes"] and all(run["update_modes"])  # every forward of the update trains
    assert checkpointed["saved_bytes"] < plain["saved_bytes"] / 2
    # the same update: checkpointing recomputes, it does not change the numbers
    assert checkpointed["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    assert checkpointed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-4) and plain["grad_norm"] > 0


def test_the_lora_reference_runs_in_evaluation_mode_and_dropout_acts_only_when_asked(tmp_path):
    lora = ["--use_peft", "--lora_target_modules", "all-linear"]
    default = run_step(tmp_path, *lora)
    assert default["ref_modes"] and not any(default["ref_modes"])  # the reference: no dropout, as the ref server
    assert default["update_modes"] and all(default["update_modes"])
    assert default["repeat_gap"] == 0.0  # --disable_dropout (the default): training mode computes one answer
    dropout = run_step(tmp_path, *lora, "--disable_dropout", "false", "--lora_dropout", "0.3")
    assert not any(dropout["ref_modes"]) and all(dropout["update_modes"])
    assert dropout["repeat_gap"] > 1e-3  # dropout draws new masks each forward


def test_lora_dropout_is_refused_while_dropout_is_disabled():
    out = subprocess.run([sys.executable, "grpo_train.py", "--use_peft", "--lora_dropout", "0.05", "--steps", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "--lora_dropout 0.05 does nothing while --disable_dropout" in out.stdout + out.stderr


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


@pytest.mark.parametrize("trainer", ["grpo_train", "grpo_vllm_one"])
def test_a_whole_run_with_gradient_checkpointing_checkpoints(tmp_path, trainer):
    (tmp_path / "sitecustomize.py").write_text(COUNTER)
    run = f"test_checkpointing_{trainer}"
    out = subprocess.run([sys.executable, f"{trainer}.py", "--beta", "0", "--gradient_checkpointing", "--steps", "2",
                          "--batch_prompts", "4", "--num_generations", "4", "--max_new_tokens", "24", "--lr", "1e-4",
                          "--threads", "1", "--save_every", "100", "--run_name", run, "--overwrite"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    counts = {path.name: int(path.read_text()) for path in tmp_path.glob("calls.*")}
    assert counts and max(counts.values()) > 0, counts  # the trainer's process checkpointed its layers
    rows = [json.loads(line) for line in open(os.path.join(ROOT, "runs", run, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2]
