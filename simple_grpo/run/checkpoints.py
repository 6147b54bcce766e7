"""A run's directory, checkpoints a kill cannot corrupt, and resuming from them (both trainers).

runs/NAME/ holds config.json, metrics.jsonl and the checkpoints (open_run starts or resumes it). A
directory an earlier run used is continued only with --resume and replaced only with --overwrite
(check_run_dir, before anything loads): nothing is deleted unasked.

runs/NAME/step_N/ holds the policy in HF format (load it with from_pretrained, evaluate it,
serve it) and, in deepspeed/, what a resumed run needs: optimizer and scheduler states, the
step, the random number generators and the data position. A checkpoint is written to
step_N.tmp/ and renamed to step_N/ only when complete: a rename is atomic, so a kill leaves
either the whole checkpoint or a .tmp/ that --resume ignores and removes. Only the latest
checkpoint keeps its deepspeed/ state (the optimizer's moments are twice the model's size).
"""
import contextlib
import json
import os
import random
import re
import shutil
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist

from simple_grpo.devices import max_over_ranks
from simple_grpo.run.disk_guard import full_disk_exit, is_disk_full, tree_bytes

STATE_DIR = "deepspeed"


def rng_states():
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states):
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def barrier():
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(engine, tokenizer, run_dir, step, state):
    """runs/NAME/step_N/: the HF model (with LoRA: the adapters, in PEFT's format) and tokenizer, and in deepspeed/ the engine's full state
    with `state` (the trainer's own: data position ...) and the RNG states. Every rank calls it.
    A save the disk has no room for ends the run (disk_guard.py) with the last checkpoint whole."""
    final = os.path.join(run_dir, f"step_{step}")
    tmp, rank0 = final + ".tmp", engine.global_rank == 0
    lora = hasattr(engine.module, "peft_config")  # step_N/ then holds the adapters (PEFT's format), not the model
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    error = None
    try:
        engine.save_checkpoint(tmp, tag=STATE_DIR, client_state={"trainer": state, "rng": rng_states()},
                               save_latest=False, exclude_frozen_parameters=lora)  # LoRA: the base is on disk
    except Exception as e:  # decided below, by every rank together
        error = e
    gather = contextlib.nullcontext()
    if engine.zero_optimization_stage() == 3:  # each rank holds a shard of every weight: gather them whole
        import deepspeed
        gather = deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None)
    with gather:  # every rank enters; rank 0 writes
        if rank0 and error is None:
            try:
                engine.module.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
            except Exception as e:
                error = e
    if max_over_ranks(error is not None):
        failed_save(run_dir, tmp, step, error, rank0)
    if rank0:
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)  # the checkpoint exists from here on, whole
        for d in checkpoint_dirs(run_dir):  # older ones keep the HF model, not the optimizer state
            if d != final:
                shutil.rmtree(os.path.join(d, STATE_DIR), ignore_errors=True)
    barrier()


def failed_save(run_dir, tmp, step, error, rank0):
    """A save failed on some rank: remove its partial step_N.tmp/ and stop every rank. A full disk
    gets a message naming it and the checkpoint a --resume continues from; another error is raised."""
    earlier = checkpoint_dirs(run_dir)
    needed = tree_bytes(earlier[-1]) if earlier else tree_bytes(tmp)  # what one whole save takes
    full = error is None or is_disk_full(error, run_dir, needed - tree_bytes(tmp))
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    if not full:
        raise error
    if error is None:  # this rank's part was written; another rank's failed
        raise SystemExit(f"step {step}'s checkpoint failed on another rank: see its message")
    resume = (f"{earlier[-1]}/ is whole: free some space, then run the same command with --resume to "
              f"continue after step {earlier[-1].rsplit('_', 1)[1]}" if earlier else
              "There is no earlier checkpoint: free some space and start again")
    raise full_disk_exit(run_dir, f"The checkpoint of step {step} was not saved (its partial copy is removed). "
                                  f"{resume}.")


def checkpoint_dirs(run_dir):
    """The complete checkpoints of a run (step_N/, not step_N.tmp/), oldest first."""
    steps = sorted(int(m.group(1)) for d in os.listdir(run_dir) if (m := re.fullmatch(r"step_(\d+)", d)))
    return [os.path.join(run_dir, f"step_{s}") for s in steps]


def load_checkpoint(engine, run_dir):
    """Restore the latest checkpoint of run_dir into the engine and the RNGs; returns (step, state)."""
    resumable = [d for d in checkpoint_dirs(run_dir) if os.path.isdir(os.path.join(d, STATE_DIR))]
    if not resumable:
        raise SystemExit(f"--resume: no checkpoint to resume from in {run_dir}/ (a run saves one every "
                         f"--save_every steps); start without --resume")
    path, client = resumable[-1], None
    lora = hasattr(engine.module, "peft_config")  # the frozen base was left out of the save: it is loaded already
    _, client = engine.load_checkpoint(path, tag=STATE_DIR, load_module_strict=not lora)
    if client is None:
        raise SystemExit(f"--resume: {path}/{STATE_DIR} could not be loaded")
    set_rng_states(client["rng"])
    return int(path.rsplit("_", 1)[1]), client["trainer"]


def remove_partial(run_dir):
    """Delete step_N.tmp/ directories a killed save left behind."""
    for d in os.listdir(run_dir):
        if re.fullmatch(r"step_\d+\.tmp", d):
            print(f"{run_dir}: removing {d}/, a checkpoint whose save was interrupted")
            shutil.rmtree(os.path.join(run_dir, d))


def keep_log_until(path, step):
    """Keep a JSON-lines log's lines up to `step` (0: none). Steps after a checkpoint are run again
    on --resume, and a line cut short by a kill is dropped."""
    rows = []
    if step > 0 and os.path.exists(path):
        with open(path) as f:
            rows = [line for line in f if line.endswith("\n") and json.loads(line)["step"] <= step]
    if rows or os.path.exists(path):
        with open(path, "w") as f:
            f.writelines(rows)


def earlier_run(run_dir):
    """What an earlier run left in run_dir: its checkpoints (whole or partial) and a metrics log
    with lines, as a short description; "" when there is none (a run that stopped before step 1)."""
    if not os.path.isdir(run_dir):
        return ""
    steps = sorted(d for d in os.listdir(run_dir) if re.fullmatch(r"step_\d+(\.tmp)?", d))
    metrics = os.path.join(run_dir, "metrics.jsonl")
    logged = os.path.isfile(metrics) and os.path.getsize(metrics) > 0
    parts = ([f"{len(steps)} checkpoint(s) up to {steps[-1]}"] if steps else []) + (["metrics.jsonl"] if logged else [])
    return " and ".join(parts)


def check_run_dir(cfg):
    """Before anything loads: a run directory in use is continued (--resume) or replaced
    (--overwrite), never deleted unasked."""
    run_dir = os.path.join("runs", cfg.run_name)
    if cfg.resume and cfg.overwrite:
        raise SystemExit("--resume continues runs/RUN_NAME, --overwrite deletes it: give one of them")
    found = earlier_run(run_dir)
    if cfg.resume and not found:
        raise SystemExit(f"--resume: no checkpoint to resume from in {run_dir}/ (no earlier run used it); "
                         f"start without --resume")
    if found and not (cfg.resume or cfg.overwrite):
        raise SystemExit(f"{run_dir}/ holds an earlier run ({found}): continue it with --resume, replace it "
                         f"with --overwrite (its checkpoints and logs are deleted), or pick another --run_name")


def open_run(cfg, engine):
    """runs/RUN_NAME/ with this config and its metrics.jsonl (and completions.jsonl): a new run starts
    them afresh; with --resume, the latest checkpoint is loaded into the engine and the logs are kept
    up to its step. Returns (run_dir, metrics_path, first step to run, the trainer state saved)."""
    run_dir = os.path.join("runs", cfg.run_name)
    os.makedirs(run_dir, exist_ok=True)
    metrics_path, first_step, state = os.path.join(run_dir, "metrics.jsonl"), 1, None
    rank0 = engine.global_rank == 0  # several ranks share run_dir: rank 0 alone changes it
    if rank0:
        remove_partial(run_dir)
    barrier()
    if cfg.resume:
        done, state = load_checkpoint(engine, run_dir)
        first_step = done + 1
        print(f"{run_dir}: resuming after step {done}")
    elif rank0 and earlier_run(run_dir):
        if not cfg.overwrite:  # check_run_dir said so before the model loaded; another run may have begun since
            check_run_dir(cfg)
        stale = sorted(d for d in os.listdir(run_dir) if d.startswith("step_"))
        print(f"{run_dir}: --overwrite: deleting the earlier run's {len(stale)} checkpoint(s) and logs")
        for d in stale:
            shutil.rmtree(os.path.join(run_dir, d))
    if rank0:
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=1)
        for log in (metrics_path, os.path.join(run_dir, "completions.jsonl")):
            keep_log_until(log, first_step - 1)
    barrier()
    return run_dir, metrics_path, first_step, state
