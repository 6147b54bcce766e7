"""bench/gpu_scale.py: what one GRPO step of grpo_vllm_one.py costs at a given model size, against the memory plan.

    python bench/gpu_scale.py --config configs/qwen2.5-0.5b                        # (a) full
    python bench/gpu_scale.py --config configs/qwen2.5-3b -- --offload_optimizer --gradient_checkpointing   # (b)
    python bench/gpu_scale.py --config configs/qwen2.5-7b --lora -- --gradient_checkpointing               # (c)
    python bench/gpu_scale.py --steps 2         # without CUDA: the tiny model's shape, the same path on the CPU

It builds a random-weight model shaped like a configs/ entry (without CUDA: like models/tiny-math) with the tiny
tokenizer, cached in --out; ids past the tokenizer's vocabulary decode to nothing. Then grpo_vllm_one.py runs
--steps steps at the GSM8K recipe's batch (recipes/gsm8k.sh: 8 prompts x 8 completions of up to 700 new tokens,
temperature 0.9, one group per forward/backward, bf16, ZeRO-2), vLLM on the trainer's GPU with the share the
memory plan says it needs (its least_gen_memory), and the reference in a ref server on the same GPU (--lora:
all-linear adapters, the base with the adapters off is the reference, no server). Flags after -- go to the
trainer and to its plan. Rewards are noise (tests/noise_rewards.py): random text ties every text reward, and a
step whose groups all tie takes no update.

Random weights sample to the token limit (EOS is 1 of Qwen's 151,936 ids; 1 of the tiny model's 561, so about half
way there): every completion is as long as it may be, the worst case for generation; a trained model's completions
are shorter. Every figure printed is of that case.

The last line printed is a JSON object; medians leave the first step out (vLLM's and the allocator's warm-up):
  s_per_step                 the trainer's whole step
  split_s                    generation (the worker's sampling, overlapped with the update), reference (the ref
                             server's forward per step, overlapped too; or the trainer's own pass with --lora),
                             update (log-probs, loss, backward, optimizer step), optimizer_step (the part of the
                             update in the optimizer's step: with offload, AdamW on the host and the copies),
                             weight_sync, wait (for a batch)
  generated_tokens_per_s     completion tokens vLLM samples per second
  trained_tokens_per_s       completion tokens the update trains on per second of update
  matmul_tflops              this device's measured rate for a large matmul in the run's dtype
  update_tflops, mfu         model FLOPs of the update per second, and that over matmul_tflops; FLOPs are 6 x the
                             linear layers' parameters per trained completion token (4 x with LoRA: the frozen
                             base gets no weight gradient). Prompts (run once per group), attention scores and
                             checkpointing's recompute are not counted: a lower bound. mfu_without_optimizer_step:
                             the same FLOPs over the forward/backward passes' seconds alone
  gpu_peak_gb, plan_gpu_gb   nvidia-smi's used memory over the idle GPU's (every process on it), and the plan's
                             training GPU (vLLM's share included); ref_server_gpu_gb is the server's own, where
                             nvidia-smi names its process, and gpu_vs_plan compares the rest with the plan
  host_peak_gb, plan_host_gb proportional memory (PSS: shared pages once) of the trainer, its vLLM worker and the
                             ref server, and the plan's host RAM; trainer_host_peak_gb leaves the server out, and
                             host_vs_plan compares it with the plan (which leaves the server's host memory out)
Without CUDA the GPU figures are null and the plan is made for an 80 GB GPU (--plan_gpu_gb).
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import requests
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from bench.harness import tree_pss, wait_peak_rss  # noqa: E402
from simple_grpo.flags import flag, parse_flags  # noqa: E402
from tools.launch import MODEL, ROOT, free_port, start_ref_server, stop  # noqa: E402
from simple_grpo.run.metrics import read_metrics  # noqa: E402
from simple_grpo.trainer.memory_plan import GB, count_parameters  # noqa: E402

NOISE_REWARD = ["--reward_file", "tests/noise_rewards.py", "--reward_funcs", "noise", "--reward_weights", "1.0"]


@dataclass
class Config:
    config: str = flag("", "the configs/ entry (a directory with config.json) the random model is shaped like; "
                           "default: configs/qwen2.5-0.5b with CUDA, models/tiny-math without")
    lora: bool = flag(False, "train all-linear LoRA adapters; the base, adapters off, is the reference (no server)")
    steps: int = flag(4, "GRPO steps; the first is left out of the medians")
    batch_prompts: int = flag(8, "prompts per step (the GSM8K recipe's)")
    num_generations: int = flag(8, "completions per prompt (the recipe's)")
    max_new_tokens: int = flag(700, "completion tokens at most (the recipe's; random weights reach it)")
    max_model_len: int = flag(1024, "vLLM's context: prompt + completion")
    dtype: str = flag("bfloat16", "the trainer's, vLLM's and the ref server's dtype")
    plan_gpu_gb: float = flag(0.0, "the GPU size the plan is made for (0: this GPU's; 80 without CUDA)")
    out: str = flag(".cache/gpu_scale", "where the random-weight models are kept, one per shape and dtype")
    run_name: str = flag("bench_gpu_scale", "the trainer's run, runs/RUN_NAME/ (replaced each time)")


def build_random_model(cfg, shape):
    """A random-weight model shaped like `shape` (a directory with config.json) with the tiny tokenizer and
    chat template, in cfg.dtype, saved once under cfg.out. Built on the GPU where there is one (7B's random
    init takes minutes on a CPU), in a child process: its CUDA memory goes with it, before anything is measured."""
    name = f"{os.path.basename(os.path.normpath(shape))}-random-{cfg.dtype}-{cfg.max_model_len}"
    path = os.path.join(ROOT, cfg.out, name)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    code = f"""
import shutil, torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
config = AutoConfig.from_pretrained({shape!r})
config.max_position_embeddings = max(config.max_position_embeddings, {cfg.max_model_len})  # room for 700 tokens
torch.manual_seed(0)
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, {cfg.dtype!r}))
model.save_pretrained({path + '.tmp'!r})
AutoTokenizer.from_pretrained({MODEL!r}).save_pretrained({path + '.tmp'!r})
shutil.copy({os.path.join(MODEL, 'chat_template.jinja')!r}, {os.path.join(path + '.tmp', 'chat_template.jinja')!r})
"""
    print(f"gpu_scale: building a random-weight model shaped like {shape} in {path}", file=sys.stderr)
    shutil.rmtree(path + ".tmp", ignore_errors=True)
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    os.rename(path + ".tmp", path)
    return path


def gpu_used_gb():
    """nvidia-smi's used memory of GPU 0, and {pid: GB} of the processes it names there."""
    query = ["nvidia-smi", "--format=csv,noheader,nounits", "-i", "0"]
    used = subprocess.run(query + ["--query-gpu=memory.used"], capture_output=True, text=True, timeout=30)
    apps = subprocess.run(query + ["--query-compute-apps=pid,used_memory"], capture_output=True, text=True, timeout=30)
    per_pid = {}
    for line in apps.stdout.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().isdigit():
            per_pid[int(pid)] = float(mib) * 2**20 / GB
    return float(used.stdout.strip()) * 2**20 / GB, per_pid


class GpuMemory:
    """Samples GPU 0's used memory every half second while a run lasts: the peak over the idle GPU's, and the
    ref server's own peak where nvidia-smi names its process (inside a container it may not)."""

    def __init__(self, server_pid=None):
        self.idle, _ = gpu_used_gb()
        self.server_pid, self.peak, self.server_peak, self.other_peak = server_pid, 0.0, None, 0.0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self):
        while not self.done.is_set():
            used, per_pid = gpu_used_gb()
            server = per_pid.get(self.server_pid)
            self.peak = max(self.peak, used - self.idle)
            if server is not None:
                self.server_peak = max(self.server_peak or 0.0, server)
                self.other_peak = max(self.other_peak, used - self.idle - server)
            time.sleep(0.5)

    def stop(self):
        self.done.set()
        self.thread.join()


def matmul_tflops(device, dtype):
    """This device's rate for an (n, n) @ (n, n) matmul in dtype, in TFLOP/s: the ceiling the MFU is measured
    against (a GPU's measured rate, not its datasheet's)."""
    n, repeats = (8192, 50) if device == "cuda" else (1024, 5)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync()
    return 2 * n ** 3 * repeats / (time.perf_counter() - t0) / 1e12


def plan(flags, gpu_gb):
    """The trainer's own memory plan for these flags (grpo_vllm_one.py --plan): its JSON line."""
    out = subprocess.run([sys.executable, "grpo_vllm_one.py", "--plan", "--plan_gpu_gb", str(gpu_gb), *flags],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"grpo_vllm_one.py --plan failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    print(out.stdout, file=sys.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def median(rows, key):
    return statistics.median(r[key] for r in rows)


def main(cfg, extra):
    cuda = torch.cuda.is_available()
    shape = cfg.config or ("configs/qwen2.5-0.5b" if cuda else MODEL)
    if not cuda and os.path.realpath(shape) != os.path.realpath(MODEL):
        raise SystemExit(f"--config {shape}: without CUDA this bench runs the tiny model's shape only (a step of a "
                         "configs/ model on CPU cores would take hours); run it on a GPU machine")
    model = build_random_model(cfg, shape)
    gpu_gb = cfg.plan_gpu_gb or (torch.cuda.get_device_properties(0).total_memory / GB if cuda else 80.0)
    flags = ["--model", model, "--dtype", cfg.dtype, "--zero_stage", "2", "--batch_prompts", str(cfg.batch_prompts),
             "--num_generations", str(cfg.num_generations), "--max_new_tokens", str(cfg.max_new_tokens),
             "--max_model_len", str(cfg.max_model_len), "--micro_batch_groups", "1", "--temperature", "0.9",
             *NOISE_REWARD, *(["--use_peft", "--lora_target_modules", "all-linear"] if cfg.lora else []), *extra]
    if cuda:  # vLLM gets the share of this GPU the plan says it needs; the plan is then made with it
        flags += ["--gen_memory", str(plan(flags, gpu_gb)["least_gen_memory"])]
    planned = plan(flags, gpu_gb)

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not cuda:  # 2 cores: one thread each for the trainer, its vLLM worker and the ref server
        env.update(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    server, port = None, free_port()
    ref_url = f"http://127.0.0.1:{port}"
    if not cfg.lora:
        server = start_ref_server(port, env, "--model", model, "--dtype", cfg.dtype,
                                  "--threads", "1", *(["--device", "cuda:0"] if cuda else []))
        flags += ["--ref_url", ref_url]
    memory = GpuMemory(server.pid if server else None) if cuda else None
    try:
        t0 = time.time()
        trainer = subprocess.Popen([sys.executable, "grpo_vllm_one.py", *flags, "--steps", str(cfg.steps),
                                    "--save_every", str(cfg.steps), "--log_completions_every", "0",
                                    "--run_name", cfg.run_name, "--overwrite"], cwd=ROOT, env=env)
        host_peak, host_peak_with_server = wait_peak_rss(trainer, also=server, measure=tree_pss)
        if trainer.returncode != 0:
            raise SystemExit(f"grpo_vllm_one.py failed with exit code {trainer.returncode}")
        print(f"gpu_scale: {cfg.steps} steps in {time.time() - t0:.0f} s with start-up and the final save",
              file=sys.stderr)
        server_stats = requests.get(ref_url + "/stats", timeout=10).json() if server else None
    finally:
        if memory:
            memory.stop()
        stop(server)

    rows, _ = read_metrics(os.path.join(ROOT, "runs", cfg.run_name, "metrics.jsonl"))
    timed = rows[1:] or rows
    synced = timed[:-1] or rows[:-1] or rows  # the last step sends no weights: there is no next batch to sample
    for r in timed:
        r["update_s"] = r["compute_s"] - r["ref_s"]
        r["passes_s"] = r["update_s"] - r["optimizer_s"]  # the forward/backward passes alone
    # per step: the server's seconds per group times the groups in a step (noise rewards: every group is kept)
    reference = server_stats["ref_s"] / server_stats["groups_out"] * cfg.batch_prompts if server \
        else median(timed, "ref_s")
    shape_info = count_parameters(model)
    linear = sum(i * o for _, i, o in shape_info["linears"])  # the matmuls' parameters, the output head's included
    flops = (4 if cfg.lora else 6) * linear * median(timed, "tokens")
    measured = matmul_tflops("cuda" if cuda else "cpu", getattr(torch, cfg.dtype))
    update_tflops = flops / median(timed, "update_s") / 1e12
    gpu_rest = None
    if memory:  # the plan counts the trainer and vLLM; the ref server is apart where nvidia-smi names it
        gpu_rest = memory.other_peak if memory.server_peak is not None else memory.peak
    result = {
        "shape": os.path.basename(os.path.normpath(shape)), "params_b": round(shape_info["params"] / 1e9, 3),
        "lora": cfg.lora, "device": torch.cuda.get_device_name(0) if cuda else "cpu", "dtype": cfg.dtype,
        "steps": len(rows), "batch": f"{cfg.batch_prompts}x{cfg.num_generations}, <= {cfg.max_new_tokens} new tokens",
        "completion_len": round(statistics.mean(r["completion_len"] for r in timed), 1),
        "s_per_step": round(median(timed, "step_s"), 3),
        "split_s": {"generation": round(median(timed, "gen_s"), 3), "reference": round(reference, 3),
                    "update": round(median(timed, "update_s"), 3),
                    "optimizer_step": round(median(timed, "optimizer_s"), 3),  # inside the update
                    "weight_sync": round(median(synced, "sync_s"), 3),
                    "wait": round(median(timed, "wait_s"), 3)},
        "generated_tokens_per_s": round(median(timed, "tokens_per_s"), 1),
        "trained_tokens_per_s": round(median(timed, "tokens") / median(timed, "update_s"), 1),
        "matmul_tflops": round(measured, 3), "update_tflops": round(update_tflops, 3),
        "mfu": round(update_tflops / measured, 4),
        "mfu_without_optimizer_step": round(flops / median(timed, "passes_s") / 1e12 / measured, 4),
        "gpu_peak_gb": round(memory.peak, 2) if memory else None,
        "ref_server_gpu_gb": round(memory.server_peak, 2) if memory and memory.server_peak is not None else None,
        "plan_gpu_gb": planned["trainer_gpu_gb"],
        "gpu_vs_plan": round(gpu_rest / planned["trainer_gpu_gb"], 3) if memory else None,
        "host_peak_gb": round(host_peak_with_server / GB, 2), "plan_host_gb": planned["host_gb"],
        "host_vs_plan": round(host_peak / GB / planned["host_gb"], 3) if planned["host_gb"] else None,
        "trainer_host_peak_gb": round(host_peak / GB, 2),
        "note": f"random weights: a token is EOS about once in {shape_info['vocab']:,}, so completions run to or near "
                f"the {cfg.max_new_tokens}-token limit (completion_len): the worst case for generation",
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    split = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    main(parse_flags(Config, __doc__, args=sys.argv[1:split]), sys.argv[split + 1:])
