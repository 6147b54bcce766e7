"""runs/NAME/: config.json, metrics.jsonl and step_N/ (the policy in HF format; the latest also keeps, in deepspeed/,
what --resume needs). A save goes to step_N.tmp/, renamed to step_N/ when whole: a kill leaves a .tmp/ that the next
start deletes. A used directory is continued only with --resume and replaced only with --overwrite."""
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
RUNS_ENV = "SIMPLE_GRPO_RUNS"  # where runs/ is, when set: the test suite gives each pytest process its own


def runs_root():
    """The folder that holds runs/RUN_NAME/: ./runs, or $SIMPLE_GRPO_RUNS where that is set (tests/conftest.py
    sets it, so that two test runs in one checkout never share a run directory)."""
    return os.environ.get(RUNS_ENV) or "runs"


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
    """runs/NAME/step_N/: the HF model (LoRA: the adapters) and tokenizer, and in deepspeed/ the engine's state, the
    trainer's `state` and the RNGs. Every rank calls it; a full disk ends the run with the last checkpoint whole."""
    import deepspeed
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
    # every rank enters, rank 0 writes; ZeRO-3's shards of each weight are gathered whole (other stages: a no-op)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
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


def keep_log_until(path, step):
    """Keep a JSON-lines log's whole lines of steps up to `step`: --resume runs the steps after it again."""
    if os.path.exists(path):
        with open(path) as f:
            rows = [line for line in f if line.endswith("\n") and json.loads(line)["step"] <= step]
        with open(path, "w") as f:
            f.writelines(rows)


def check_run_dir(cfg):
    """Before anything loads: a runs/RUN_NAME/ with checkpoints (whole or partial) or logged lines is continued
    with --resume or replaced with --overwrite, never deleted unasked."""
    run_dir = os.path.join(runs_root(), cfg.run_name)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if cfg.resume and cfg.overwrite:
        raise SystemExit("--resume continues runs/RUN_NAME, --overwrite deletes it: give one of them")
    saves = sorted((d for d in os.listdir(run_dir) if re.fullmatch(r"step_\d+(\.tmp)?", d)),
                   key=lambda d: int(re.sub(r"\D", "", d))) if os.path.isdir(run_dir) else []
    found = " and ".join(([f"{len(saves)} checkpoint(s) up to {saves[-1]}"] if saves else []) +
                         (["metrics.jsonl"] if os.path.isfile(metrics) and os.path.getsize(metrics) else []))
    if cfg.resume and not found:
        raise SystemExit(f"--resume: no checkpoint to resume from in {run_dir}/ (no earlier run used it); "
                         f"start without --resume")
    if found and not (cfg.resume or cfg.overwrite):
        raise SystemExit(f"{run_dir}/ holds an earlier run ({found}): continue it with --resume, replace it "
                         f"with --overwrite (its checkpoints and logs are deleted), or pick another --run_name")


def open_run(cfg, engine):
    """runs/RUN_NAME/ with this config.json: a new run starts its logs empty; --resume loads the latest checkpoint
    into the engine and keeps the logs up to its step. Returns (run_dir, metrics_path, first step, saved state)."""
    run_dir, first_step, state = os.path.join(runs_root(), cfg.run_name), 1, None
    metrics_path, rank0 = os.path.join(run_dir, "metrics.jsonl"), engine.global_rank == 0  # rank 0 alone writes
    if rank0:
        check_run_dir(cfg)  # again: another run may have begun in it since
        os.makedirs(run_dir, exist_ok=True)
        for d in os.listdir(run_dir):  # saves that were interrupted; with --overwrite, every checkpoint
            if re.fullmatch(r"step_\d+\.tmp", d) or cfg.overwrite and d.startswith("step_"):
                print(f"{run_dir}: {'--overwrite: deleting' if cfg.overwrite else 'removing'} {d}/")
                shutil.rmtree(os.path.join(run_dir, d))
    barrier()
    if cfg.resume:
        done, state = load_checkpoint(engine, run_dir)
        first_step = done + 1
        print(f"{run_dir}: resuming after step {done}")
    if rank0:
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=1)
        for log in (metrics_path, os.path.join(run_dir, "completions.jsonl")):
            keep_log_until(log, first_step - 1)
    barrier()
    return run_dir, metrics_path, first_step, state
