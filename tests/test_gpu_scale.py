"""bench/gpu_scale.py on this CPU: the same path as on a GPU (a random-weight model, the ref server, vLLM,
DeepSpeed, the plan), on the tiny model's shape and a small batch; its JSON object has every figure. And the two
things it counts with: the update's phases (simple_grpo/run/phase_timer.py's timed_update: grpo_update's stats and its phases) and the
hardware FLOPs it divides by their seconds (hardware_flops, checked against torch's FLOP counter)."""
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from bench.gpu_scale import hardware_flops
from grpo_math import completion_mask
from simple_grpo.train import Config
from simple_grpo.run.checkpoints import runs_root
from simple_grpo.run.phase_timer import PHASES, UpdatePhases, busy_seconds, timed_update
from simple_grpo.trainer.config import check_options
from simple_grpo.trainer.deepspeed_engine import make_engine
from simple_grpo.trainer.memory_plan import count_parameters
from simple_grpo.trainer.update import grpo_update, reference_logps
from tools.launch import MODEL, ROOT

FIGURES = ("s_per_step", "generated_tokens_per_s", "trained_tokens_per_s", "matmul_tflops", "update_tflops", "mfu",
           "mfu_without_optimizer_step", "hardware_tflop", "hfu", "plan_gpu_gb", "host_peak_gb",
           "trainer_host_peak_gb", "completion_len")
GPU_ONLY = ("gpu_peak_gb", "ref_server_gpu_gb", "gpu_vs_plan", "update_gpu_wait_s")
Q, G, P, C = 2, 4, 24, 32  # prompts, completions each, their padded lengths


def tiny_update(**flags):
    """The tiny model as a DeepSpeed engine with these flags, and a batch of random tokens for its update."""
    cfg = Config(model=MODEL, lr=1e-3, seed=0, micro_batch_groups=1, **flags)
    check_options(cfg)
    engine, tokenizer = make_engine(cfg)
    torch.manual_seed(0)
    batch = {"prompt_ids": torch.randint(10, 400, (Q, P)), "prompt_mask": torch.ones(Q, P, dtype=torch.long),
             "completion_ids": torch.randint(10, 400, (Q * G, C)), "advantages": torch.randn(Q * G)}
    batch["loss_mask"] = completion_mask(batch["completion_ids"], tokenizer.eos_token_id)
    return cfg, engine, tokenizer.eos_token_id, batch


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_updates_phases_add_up_to_its_seconds_and_recompute_is_checkpointings(checkpointing):
    cfg, engine, eos, batch = tiny_update(beta=0.0, gradient_checkpointing=checkpointing)
    def hooks():
        return [(m._forward_hooks.copy(), m._forward_pre_hooks.copy()) for m in engine.module.modules()]

    before = hooks()  # DeepSpeed's own
    t0 = time.perf_counter()
    stats, _ = timed_update(grpo_update, engine, batch, cfg)  # simple_grpo/train.py --time_phases
    seconds = time.perf_counter() - t0
    phases = {phase: stats[f"{phase}_s"] for phase in PHASES}
    assert all(phases[p] > 0 for p in ("forward", "log_softmax", "backward", "loss", "optimizer")), phases
    assert (phases["recompute"] > 0) == checkpointing, phases
    assert sum(phases.values()) == pytest.approx(seconds, rel=0.1), (phases, seconds)
    assert hooks() == before  # the timing hooks come off with the update, and the engine's wrappers
    assert not {"backward", "step", "set_gradient_accumulation_boundary"} & set(vars(engine))


def one_step_of_the_trainer(run_name, *flags):
    """simple_grpo/train.py, one step of the tiny model without a KL term (no ref server), with Python naming every
    module each of its processes imports (PYTHONPROFILEIMPORTTIME, on stderr): the step's metrics.jsonl record and
    the modules imported."""
    run_dir = os.path.join(ROOT, runs_root(), run_name)  # this pytest process's runs (tests/conftest.py)
    shutil.rmtree(run_dir, ignore_errors=True)
    done = subprocess.run([sys.executable, "-m", "simple_grpo.train", "--beta", "0", "--steps", "1",
                           "--batch_prompts", "2", "--num_generations", "4", "--max_new_tokens", "16",
                           "--save_every", "100", "--run_name", run_name, *flags], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env=dict(os.environ, PYTHONPROFILEIMPORTTIME="1"))
    # "import time: self | cumulative | module", anywhere in a line: the progress bar's line has no newline
    imported = set(re.findall(r"import time: +\d+ \| +\d+ \| +([\w.]+)", done.stderr))
    assert done.returncode == 0, re.sub(r"import time:.*\n", "", done.stderr)[-3000:]
    assert "simple_grpo.trainer.update" in imported, "Python named none of the trainer's imports"
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [r for r in map(json.loads, f) if "loss" in r]
    assert [r["step"] for r in records] == [1], records
    return records[0], imported


@pytest.mark.slow  # ~1.5 min on two busy cores: two runs, each starting vLLM
def test_the_trainer_times_its_update_by_phase_only_with_time_phases():
    """Without --time_phases simple_grpo/train.py's update is untimed: the phase timer is never imported (so no hook on
    the model and no wait for the device) and the step logs no phase's seconds. With it, it logs every phase."""
    untimed, imported = one_step_of_the_trainer("test_untimed_update")
    assert "simple_grpo.run.phase_timer" not in imported
    assert not [key for key in untimed if key in {f"{phase}_s" for phase in PHASES}], untimed
    timed, imported = one_step_of_the_trainer("test_timed_update", "--time_phases")
    assert "simple_grpo.run.phase_timer" in imported
    assert all(timed[f"{phase}_s"] >= 0 for phase in PHASES) and timed["forward_s"] > 0, timed


def test_busy_seconds_are_the_union_of_a_traces_ops_and_leave_the_idle_time_out():
    a = torch.randn(256, 256)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as trace:
        t0 = time.perf_counter()
        a @ a
        time.sleep(0.3)  # the device idle: no op runs
        a @ a
        seconds = time.perf_counter() - t0
    events = trace.events()
    matmuls = sum(e.time_range.elapsed_us() for e in events if e.name == "aten::matmul") / 1e6  # the two, whole
    busy = busy_seconds(events, torch.autograd.DeviceType.CPU)
    assert busy == pytest.approx(matmuls, rel=1e-6) and busy < seconds - 0.3
    assert sum(e.time_range.elapsed_us() for e in events) / 1e6 > busy  # ops nest (matmul holds mm): once each


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_profiling_an_update_without_cuda_is_refused():
    with pytest.raises(ValueError, match="GPU's idle seconds in it: it needs CUDA"):
        UpdatePhases(engine=None, profile=True)


@pytest.mark.parametrize("checkpointing,lora_r", [(False, 0), (True, 0), (True, 16)])
def test_the_hardware_flops_are_the_matmuls_torch_counts_in_the_update(checkpointing, lora_r):
    flags = {"use_peft": True, "lora_r": lora_r, "lora_target_modules": "all-linear"} if lora_r else {"beta": 0.0}
    cfg, engine, eos, batch = tiny_update(gradient_checkpointing=checkpointing, **flags)
    with FlopCounterMode(display=False) as reference:
        if lora_r:
            batch["ref_logps"] = reference_logps(engine, batch, cfg)
    with FlopCounterMode(display=False) as update:
        grpo_update(engine, batch, cfg)
    # torch counts no attention on a CPU (its attention kernel has no FLOP formula there): layers=0 leaves it out
    shape = {**count_parameters(MODEL), "layers": 0}
    counted_update, counted_reference = hardware_flops(shape, Q, G, P, C, checkpointing, lora_r, iterations=1)
    assert counted_reference == reference.get_total_flops()
    # LoRA: autograd skips the first layer's input gradients (the frozen embedding needs none), ~1% here
    assert counted_update == pytest.approx(update.get_total_flops(), rel=0.03 if lora_r else 1e-9)


# ~2 x 40-85 s on 2 cores: the whole GRPO path of a bench, twice, so `make test-all` runs it and `make test` leaves it
@pytest.mark.slow
def test_gpu_scale_prints_each_lengths_step_its_split_phases_hfu_and_memory_beside_the_plan_on_a_cpu(tmp_path):
    done = subprocess.run([sys.executable, "bench/gpu_scale.py", "--steps", "2", "--batch_prompts", "2",
                           "--num_generations", "4", "--lengths", "32,12", "--max_model_len", "256",
                           "--out", str(tmp_path), "--run_name", "test_gpu_scale"],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    by_length = json.loads(done.stdout.strip().splitlines()[-1])["by_length"]
    assert list(by_length) == ["32", "12"]
    assert by_length["12"]["completion_len"] <= 12 < by_length["32"]["completion_len"] <= 32
    for result in by_length.values():
        assert result["shape"] == "tiny-math" and result["device"] == "cpu" and result["steps"] == 2
        assert all(result[key] > 0 for key in FIGURES), result
        split = result["split_s"]
        assert set(split) == {"generation", "reference", "update", "optimizer_step", "weight_sync", "wait"}
        assert all(split[p] > 0 for p in ("generation", "reference", "update", "optimizer_step", "weight_sync")), split
        assert split["optimizer_step"] < split["update"]  # a part of it
        phases = result["update_phases_s"]
        assert set(phases) == {*PHASES, "other"} and phases["recompute"] == 0  # no --gradient_checkpointing
        assert sum(phases[p] for p in PHASES) == pytest.approx(split["update"], rel=0.1), (phases, split)
        assert result["mfu"] < result["mfu_without_optimizer_step"] < 1
        assert result["mfu"] < result["hfu"] < 1  # the prompts and attention count as hardware FLOPs, not model
        assert all(result[key] is None for key in GPU_ONLY), result  # no nvidia-smi here: not measured, not zero
        assert "random weights" in result["note"]


def test_a_length_that_leaves_no_room_for_the_prompt_is_refused():
    done = subprocess.run([sys.executable, "bench/gpu_scale.py", "--lengths", "700,1024"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "--lengths 700,1024: each must leave room for the prompt" in done.stderr


def test_without_cuda_a_configs_shape_is_refused_before_anything_is_built(tmp_path):
    done = subprocess.run([sys.executable, "bench/gpu_scale.py", "--config", "configs/qwen2.5-3b", "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "without CUDA this bench runs the tiny model's shape only" in done.stderr
    assert not list(tmp_path.iterdir())
