"""bench/gpu_scale.py: what one GRPO step of the full trainer (simple_grpo/train.py) costs at a given model size,
against the memory plan.

    python bench/gpu_scale.py --config configs/qwen2.5-0.5b                        # (a) full
    python bench/gpu_scale.py --config configs/qwen2.5-3b -- --offload_optimizer --gradient_checkpointing   # (b)
    python bench/gpu_scale.py --config configs/qwen2.5-7b --lora -- --gradient_checkpointing               # (c)
    python bench/gpu_scale.py --steps 2         # without CUDA: the tiny model's shape, the same path on the CPU
    python bench/gpu_scale.py --config configs/qwen2.5-3b --lengths 700,300 -- --offload_optimizer ...  # two lengths

It builds a random-weight model shaped like a configs/ entry (without CUDA: like models/tiny-math) with the tiny
tokenizer, cached in --out; ids past the tokenizer's vocabulary decode to nothing. Then simple_grpo.train runs
--steps steps at the GSM8K recipe's batch (recipes/gsm8k.sh: 8 prompts x 8 completions of up to 700 new tokens,
temperature 0.9, one group per forward/backward, bf16, ZeRO-2), vLLM on the trainer's GPU with the share the
memory plan says it needs (its least_gen_memory), and the reference in a ref server on the same GPU (--lora:
all-linear adapters, the base with the adapters off is the reference, no server). Flags after -- go to the
trainer and to its plan. Rewards are noise (tests/noise_rewards.py): random text ties every text reward, and a
step whose groups all tie takes no update.

Random weights sample to the token limit (EOS is 1 of Qwen's 151,936 ids; 1 of the tiny model's 561, so about half
way there): every completion is as long as it may be, the worst case for generation; a trained model's completions
are shorter. Every figure printed is of that case. --lengths 700,300 runs the bench once per completion limit, one
after the other (300 stands for a trained model's shorter GSM8K answers); each prints its JSON line, and the last
line holds them all, {"by_length": {"700": {...}, "300": {...}}}.

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
  hardware_tflop, hfu        the FLOPs a step's update really runs, in TFLOP (hardware_flops below: prompts and
                             padding, attention, recompute, LoRA's backward without the base's weight gradients;
                             with --lora the trainer's reference pass too), and those per second of the update
                             (with the reference pass) over matmul_tflops: the hardware FLOPs utilization. Shapes:
                             completions padded to each step's longest, prompts to a batch's longest as drawn from
                             the run's problems (padded_prompt_len)
  update_phases_s            the update by phase (simple_grpo/run/phase_timer.py): forward, log_softmax (over the
                             vocabulary, forward and backward), recompute (--gradient_checkpointing), backward,
                             loss, optimizer (with --offload_optimizer: AdamW on the host and the copies); other:
                             the update's seconds outside them (moving the batch, the diagnostics)
  update_gpu_wait_s          CUDA: the seconds of the last step's update in which the GPU ran nothing (the trainer's
                             --profile_step: torch.profiler's trace of its kernels and copies). The profiler slows
                             that step, so the medians leave it out where another step is left to take them from
  gpu_peak_gb, plan_gpu_gb   nvidia-smi's used memory over the idle GPU's (every process on it), and the plan's
                             training GPU (vLLM's share included); ref_server_gpu_gb is the server's own, where
                             nvidia-smi names its process, and gpu_vs_plan compares the rest with the plan
  host_peak_gb, plan_host_gb proportional memory (PSS: shared pages once) of the trainer, its vLLM worker and the
                             ref server, and the plan's host RAM; trainer_host_peak_gb leaves the server out, and
                             host_vs_plan compares it with the plan (which leaves the server's host memory out)
Without CUDA the GPU figures are null and the plan is made for an 80 GB GPU (--plan_gpu_gb).
"""
import dataclasses
import json
import os
import random
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
from simple_grpo.run.checkpoints import runs_root  # noqa: E402
from simple_grpo.run.phase_timer import PHASES  # noqa: E402
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
    lengths: str = flag("", "completion limits to run one after another, e.g. 700,300 (each in --max_new_tokens' "
                            "place; 300 stands for a trained model's shorter answers); empty: --max_new_tokens alone")


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
    """The trainer's own memory plan for these flags (python -m simple_grpo.train --plan): its JSON line."""
    out = subprocess.run([sys.executable, "-m", "simple_grpo.train", "--plan", "--plan_gpu_gb", str(gpu_gb), *flags],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"simple_grpo.train --plan failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    print(out.stdout, file=sys.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def padded_prompt_len(run_dir, batch_prompts, draws=200):
    """The batch's prompt length in tokens, padding included (a batch's prompts are padded to its longest): the
    mean over `draws` random batches of the run's problems, with its prompt format and the model's tokenizer."""
    from types import SimpleNamespace
    from transformers import AutoTokenizer
    from simple_grpo.task.problems import load_data, make_prompt
    run = SimpleNamespace(**json.load(open(os.path.join(run_dir, "config.json"))))
    tokenizer, rng = AutoTokenizer.from_pretrained(run.model), random.Random(0)
    problems = load_data(run)
    problems = rng.sample(problems, min(len(problems), 2000))
    lengths = [len(tokenizer(make_prompt(tokenizer, p["question"], run.prompt_format, run.system_prompt),
                             add_special_tokens=False)["input_ids"]) for p in problems]
    return statistics.mean(max(rng.sample(lengths, batch_prompts)) for _ in range(draws))


def hardware_flops(shape, Q, G, P, C, checkpointing, lora_r, iterations):
    """The FLOPs one step's update runs on Q prompts padded to P tokens and Q*G completions padded to C, as
    simple_grpo/logprobs.py's sequence_logps runs them, and with LoRA (lora_r > 0, all-linear) the trainer's
    reference pass; returns (update, reference). A matmul of n x k by k x m is 2nkm; attention's scores and
    values are 4 x the context x the queries' width per token and layer, over the causal context (half the
    sequence on average); the vocabulary's log-softmax (element-wise) is not counted. Without checkpointing a
    group's prompt runs once and its completions on copies of its KV cache; with it, each completion runs whole,
    prompt included, and backward runs each layer's forward again, without its last matmul (down_proj: backward
    needs its input, not its output, and torch's checkpoint stops once it has what backward needs; with LoRA its
    adapters come after it, so it runs too). Backward computes every matmul's input gradient, and the weight
    gradient of those that train: not the frozen base's under LoRA. tests/test_gpu_scale.py checks the matmuls
    against torch's FLOP counter on the tiny model's real update."""
    head = sum(i * o for name, i, o in shape["linears"] if name == "lm_head")  # the output layer's weights
    body = sum(i * o for name, i, o in shape["linears"] if name != "lm_head")  # the decoder layers' linear weights
    last = sum(i * o for name, i, o in shape["linears"] if name == "down_proj")
    adapters = lora_r * sum(i + o for name, i, o in shape["linears"] if name != "lm_head")  # r x (in + out) each
    width = next(o for name, i, o in shape["linears"] if name == "q_proj")  # the queries': heads x head_dim

    def passes(cached):  # (tokens, their mean context) of each model call, and the logits kept
        if cached:  # the prompts (their last logit), then the completions on the prompts' caches
            return [(Q * P, P / 2), (Q * G * (C - 1), P + C / 2)], Q + Q * G * (C - 1)
        return [(Q * G * (P + C), (P + C) / 2)], Q * G * (C + 1)  # C + 1 logits kept (logits_to_keep)

    calls, logits = passes(cached=not checkpointing)
    tokens = sum(n for n, _ in calls)
    attention = sum(4 * context * width * shape["layers"] * n for n, context in calls)  # forward
    matmuls = body + adapters
    trained, head_trained = (adapters, 0) if lora_r else (body, head)
    forward = 2 * matmuls * tokens + 2 * head * logits + attention
    backward = 2 * (matmuls + trained) * tokens + 2 * (head + head_trained) * logits + 2 * attention
    recompute = 2 * (matmuls - (0 if lora_r else last)) * tokens + attention if checkpointing else 0
    reference = 0
    if lora_r:  # the base with its adapters off, in evaluation mode (the cached path), without gradients
        calls, logits = passes(cached=True)
        reference = sum(2 * body * n + 4 * context * width * shape["layers"] * n for n, context in calls)
        reference += 2 * head * logits
    return iterations * (forward + recompute + backward), reference


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
        profile = ["--profile_step", str(cfg.steps)] if cuda else []  # the last step's GPU idle seconds
        trainer = subprocess.Popen([sys.executable, "-m", "simple_grpo.train", *flags, *profile, "--time_phases",
                                    "--steps", str(cfg.steps),
                                    "--save_every", str(cfg.steps), "--log_completions_every", "0",
                                    "--run_name", cfg.run_name, "--overwrite"], cwd=ROOT, env=env)
        host_peak, host_peak_with_server = wait_peak_rss(trainer, also=server, measure=tree_pss)
        if trainer.returncode != 0:
            raise SystemExit(f"simple_grpo.train failed with exit code {trainer.returncode}")
        print(f"gpu_scale: {cfg.steps} steps in {time.time() - t0:.0f} s with start-up and the final save",
              file=sys.stderr)
        server_stats = requests.get(ref_url + "/stats", timeout=10).json() if server else None
    finally:
        if memory:
            memory.stop()
        stop(server)

    run_dir = os.path.join(ROOT, runs_root(), cfg.run_name)
    rows, _ = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    gpu_wait = rows[-1].get("gpu_wait_s")  # the profiled step's (CUDA)
    timed = rows[1:] or rows
    if gpu_wait is not None and len(timed) > 1:
        timed = timed[:-1]  # the profiled step is slower: it gives gpu_wait alone
    # the last step sends no weights: there is no next batch to sample
    synced = [r for r in timed if r is not rows[-1]] or rows[:-1] or rows
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
    run = json.load(open(os.path.join(run_dir, "config.json")))
    hardware = hardware_flops(shape_info, cfg.batch_prompts, cfg.num_generations,
                              padded_prompt_len(run_dir, cfg.batch_prompts), median(timed, "completion_len_max"),
                              run["gradient_checkpointing"], run["lora_r"] if cfg.lora else 0, run["num_iterations"])
    # the update's phases, each a median over the steps; other: the update's seconds outside them
    phases = {phase: median(timed, f"{phase}_s") for phase in PHASES}
    for r in timed:
        r["other_s"] = r["update_s"] - sum(r[f"{phase}_s"] for phase in PHASES)
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
        "hardware_tflop": round(sum(hardware) / 1e12, 4),  # a step's: the update's, and the LoRA reference pass's
        "hfu": round(sum(hardware) / median(timed, "compute_s") / 1e12 / measured, 4),
        "update_phases_s": {**{phase: round(seconds, 3) for phase, seconds in phases.items()},
                            "other": round(median(timed, "other_s"), 3)},
        "update_gpu_wait_s": round(gpu_wait, 3) if gpu_wait is not None else None,
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
    cfg = parse_flags(Config, __doc__, args=sys.argv[1:split])
    if not cfg.lengths:
        main(cfg, sys.argv[split + 1:])
    else:  # one bench per completion limit, then all of them on the last line
        lengths = [int(n) for n in cfg.lengths.split(",")]
        if max(lengths) >= cfg.max_model_len:
            raise SystemExit(f"--lengths {cfg.lengths}: each must leave room for the prompt in --max_model_len "
                             f"{cfg.max_model_len}")
        results = {n: main(dataclasses.replace(cfg, max_new_tokens=n), sys.argv[split + 1:]) for n in lengths}
        print(json.dumps({"by_length": results}))
