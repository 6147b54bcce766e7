"""bench/gpu_scale.py on this CPU: the same path as on a GPU (a random-weight model, the ref server, vLLM,
DeepSpeed, the plan), on the tiny model's shape and a small batch; its JSON object has every figure."""
import json
import subprocess
import sys

import pytest

from simple_grpo.run.launch import ROOT

FIGURES = ("s_per_step", "generated_tokens_per_s", "trained_tokens_per_s", "matmul_tflops", "update_tflops", "mfu",
           "mfu_without_optimizer_step", "plan_gpu_gb", "host_peak_gb", "trainer_host_peak_gb", "completion_len")
GPU_ONLY = ("gpu_peak_gb", "ref_server_gpu_gb", "gpu_vs_plan")


# ~40-85 s on 2 cores: the whole GRPO path of a bench, so `make test-all` runs it and `make test` leaves it
@pytest.mark.slow
def test_gpu_scale_prints_a_step_its_split_and_memory_beside_the_plan_on_a_cpu(tmp_path):
    done = subprocess.run([sys.executable, "bench/gpu_scale.py", "--steps", "2", "--batch_prompts", "2",
                           "--num_generations", "4", "--max_new_tokens", "32", "--max_model_len", "256",
                           "--out", str(tmp_path), "--run_name", "test_gpu_scale"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["shape"] == "tiny-math" and result["device"] == "cpu" and result["steps"] == 2
    assert all(result[key] > 0 for key in FIGURES), result
    split = result["split_s"]
    assert set(split) == {"generation", "reference", "update", "optimizer_step", "weight_sync", "wait"}
    assert all(split[part] > 0 for part in ("generation", "reference", "update", "optimizer_step", "weight_sync")), split
    assert split["optimizer_step"] < split["update"]  # a part of it
    assert result["mfu"] < result["mfu_without_optimizer_step"] < 1
    assert all(result[key] is None for key in GPU_ONLY), result  # no nvidia-smi here: not measured, not zero
    assert result["mfu"] < 1 and "random weights" in result["note"]


def test_without_cuda_a_configs_shape_is_refused_before_anything_is_built(tmp_path):
    done = subprocess.run([sys.executable, "bench/gpu_scale.py", "--config", "configs/qwen2.5-3b", "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "without CUDA this bench runs the tiny model's shape only" in done.stderr
    assert not list(tmp_path.iterdir())
