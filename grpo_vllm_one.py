r"""grpo_vllm_one.py: GRPO with vLLM, the whole default step in one file. Read grpo_train.py first.

    python ref_server.py & python grpo_vllm_one.py    # make demo: the tiny model and the toy task, on a CPU
    python ref_server.py --model Qwen/Qwen2.5-0.5B --device cuda:0 &
    deepspeed --include localhost:1 grpo_vllm_one.py --model Qwen/Qwen2.5-0.5B --dataset openai/gsm8k \
        --dataset_config main --dtype bfloat16 --gen_device 2      # the trainer on GPU 1, vLLM on GPU 2

Two processes, one step apart: while the trainer (main) computes step s, vLLM (gen_worker) samples step s+1's
batch with step s-1's weights, so each token's policy-gradient term is weighted by min(pi_old / pi_vLLM,
--tis_cap). `# GRPO n.` marks the algorithm, the rest is plumbing. LoRA, resume, several vLLM workers, the
loss variants, ZeRO-3: the full trainer (python -m simple_grpo.train). Shapes: Q problems, G completions
each, B = Q*G rows, P prompt and C completion tokens.
"""
import argparse
import ctypes
import json
import os
import random
import re
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from unittest import mock

import requests
import torch
import torch.distributed as dist
from safetensors.torch import load as load_message, save as save_message
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, HfArgumentParser

from grpo_math import completion_logps, completion_mask, group_advantages, groups_with_signal, grpo_loss


def flag(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    model: str = flag("models/tiny-math", "the policy's starting point: an HF model directory or hub name")
    dataset: str = flag("data/toy_math/train.jsonl", "problems: .jsonl, or a hub dataset (openai/gsm8k)")
    dataset_config: str = flag("", "a hub dataset's config (main for openai/gsm8k)")
    steps: int = flag(200, "training steps: a batch of groups and one optimizer step each")
    batch_prompts: int = flag(8, "problems sampled per step: Q")
    num_generations: int = flag(8, "completions per problem: the group size G")
    max_new_tokens: int = flag(48, "the longest completion, in tokens")
    min_new_tokens: int = flag(0, "no stop token before this many tokens (benchmarks at a fixed length)")
    temperature: float = flag(0.7, "sampling temperature; the log-probs are taken at it too")
    advantage_eps: float = flag(1e-4, "added to a group's reward std: equal rewards give 0, not 0/0")
    beta: float = flag(0.04, "weight of the KL penalty to the reference model")
    epsilon: float = flag(0.2, "PPO clip range: the ratio is clipped to [1 - epsilon, 1 + epsilon]")
    tis_cap: float = flag(2.0, "each token's weight is min(pi_old / pi_vLLM, tis_cap); > 0")
    lr: float = flag(0.0, "AdamW's learning rate; 0: 1e-4 for the tiny default model, 1e-6 for others")
    max_grad_norm: float = flag(1.0, "the gradients' global 2-norm is clipped to this before each step")
    max_model_len: int = flag(512, "vLLM's context: prompt + completion")
    ref_url: str = flag("http://127.0.0.1:59875", "the reference server (python ref_server.py)")
    ref_token: str = flag("", "the ref server's shared token, if it has one (default: $SIMPLE_GRPO_TOKEN)")
    gen_device: int = flag(-1, "GPUs: vLLM's GPU as nvidia-smi numbers it; -1: the one after the trainer's")
    gen_memory: float = flag(0.0, "GPUs: vLLM's share of its GPU's memory; 0: 0.9 (its own), 0.3 (shared)")
    dtype: str = flag("float32", "float32, or bfloat16 (GPUs)")
    zero_stage: int = flag(0, "DeepSpeed's ZeRO stage: 0, 1 or 2 (3: the full trainer)")
    gradient_checkpointing: bool = flag(False, "recompute activations in backward: less memory, more compute")
    loss_impl: str = flag("torch", "torch, or triton: the loss in one fused kernel (triton_loss/)")
    run_name: str = flag("vllm_one", "outputs go to runs/RUN_NAME/ (or $SIMPLE_GRPO_RUNS/RUN_NAME/)")
    overwrite: bool = flag(False, "replace runs/RUN_NAME/ if an earlier run used it (it is deleted)")
    save_every: int = flag(100, "steps between checkpoints (HF format; one at the end too)")
    log_completions_every: int = flag(10, "every N steps, one group's completions to completions.jsonl")
    seed: int = flag(0, "seed of the problem draws, the sampling and the trainer")
    threads: int = flag(1, "the trainer's CPU threads (vLLM's process is pinned to the last core)")
    startup_timeout: float = flag(1200.0, "more seconds for each group of step 1: vLLM's start-up")
    data_timeout: float = flag(600.0, "seconds to wait for each group of a batch once vLLM is up")
    peer_timeout: float = flag(30.0, "seconds the ref server may not answer before the run stops")
    local_rank: int = flag(-1, "set by the deepspeed launcher")

    def __post_init__(self):  # --lr 0: the default model's (this file's models/tiny-math) or another's
        tiny = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "tiny-math")
        self.lr = self.lr or (1e-4 if os.path.realpath(self.model) == os.path.realpath(tiny) else 1e-6)


def deepspeed_config(cfg):
    """One engine.step(): clip the gradients' norm to --max_grad_norm, one AdamW step (torch's), zero them."""
    adamw = {"lr": cfg.lr, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.0, "torch_adam": True}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "gradient_clipping": cfg.max_grad_norm, "bf16": {"enabled": cfg.dtype == "bfloat16"},
            "zero_optimization": {"stage": cfg.zero_stage}, "zero_force_ds_cpu_optimizer": False,
            "optimizer": {"type": "AdamW", "params": adamw}}


# ----------------------------------------------------------------------- the task: problems, prompt, reward
SYSTEM_PROMPT = ("A conversation between User and Assistant. The user asks a question, and the Assistant"
                 " solves it. The Assistant first thinks about the reasoning process in the mind and then"
                 " provides the user with the answer. The reasoning process and answer are enclosed within"
                 " <think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning"
                 " process here </think><answer> answer here </answer>.")
NO_LOGP = 1.0  # vLLM's log-prob past a completion's end: no log-prob is > 0, and times a mask of 0 it is 0


def load_problems(cfg):
    """[{"question", "answer"}] in GSM8K's format (the answer ends "#### N"): a .jsonl file, or the hub's."""
    try:
        if cfg.dataset.endswith(".jsonl"):
            with open(cfg.dataset, encoding="utf-8") as f:
                rows = [json.loads(line) for line in f if line.strip()]
        else:
            import datasets
            rows = datasets.load_dataset(cfg.dataset, cfg.dataset_config or None, split="train")
        problems = [{"question": row["question"], "answer": row["answer"]} for row in rows]
    except (OSError, ValueError, KeyError, TypeError) as e:  # no such file, not JSON, no such field
        raise SystemExit(f"--dataset {cfg.dataset}: {type(e).__name__} {str(e)[:200]}") from None
    if bad := [i for i, p in enumerate(problems, 1) if "####" not in str(p["answer"])]:
        raise SystemExit(f"--dataset {cfg.dataset}: row {bad[0]}'s answer has no '#### N' line (GSM8K's)")
    return problems


def make_prompt(tokenizer, question):
    """The model's chat template with the system prompt, the assistant's turn opened."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def stop_token_ids(tokenizer, model):
    """The one stop set, vLLM's and the masks': EOS, the chat template's turn end, the generation config's."""
    try:
        eos = GenerationConfig.from_pretrained(model).eos_token_id
    except OSError:  # no generation_config.json: config.json's
        eos = AutoConfig.from_pretrained(model).eos_token_id
    marker = "\u2063answer\u2063"  # what follows an assistant's turn begins with the turn's end token
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}]
    turn = tokenizer.apply_chat_template(messages, tokenize=False)
    after = tokenizer(turn.split(marker, 1)[1], add_special_tokens=False)["input_ids"]
    turn_end = after[0] if after and after[0] in tokenizer.all_special_ids else None
    ids = [tokenizer.eos_token_id, turn_end, *([eos] if isinstance(eos, int) else eos or [])]
    return list(dict.fromkeys(i for i in ids if i is not None))  # in order, once each


def score(completion, answer):
    """correctness: 1 when the last <answer>...</answer> equals the number after '####' (math-verify);
    format: 1 for <think>...</think><answer>...</answer>, each tag once; reward: correctness + 0.5 format."""
    from math_verify import parse, verify
    found, gold = re.findall(r"<answer>(.*?)</answer>", completion, re.DOTALL), answer.split("####")[-1]
    predicted, gold, correct = (found[-1].strip() if found else ""), gold.strip().replace(",", ""), 0.0
    if predicted:
        gold, predicted = parse(gold, parsing_timeout=5), parse(predicted, parsing_timeout=5)
        correct = float(bool(gold) and bool(predicted) and verify(gold, predicted, timeout_seconds=5))
    tags_once = all(completion.count(tag) == 1 for tag in ("<think>", "</think>", "<answer>", "</answer>"))
    shaped = re.match(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", completion, re.DOTALL) is not None
    form = float(tags_once and shaped)
    return {"correctness": correct, "format": form, "reward": 1.0 * correct + 0.5 * form}


# ---------------------------------------------------------------------------- the ref server's client
def ref_request(cfg, method, path, **kw):
    """One HTTP call to the ref server, tried again while it does not answer, for --peer_timeout seconds."""
    token = cfg.ref_token or os.environ.get("SIMPLE_GRPO_TOKEN", "")
    headers, start = ({"Authorization": f"Bearer {token}"} if token else {}), time.time()
    while True:
        try:
            r = requests.request(method, cfg.ref_url + path, headers=headers, timeout=cfg.peer_timeout, **kw)
            if r.status_code not in (200, 204, 503):  # 204: nothing finished yet; 503: its queue is full
                raise SystemExit(f"ref server at {cfg.ref_url}{path}: HTTP {r.status_code} {r.text[:200]}")
            return r
        except requests.RequestException as e:
            if time.time() - start > cfg.peer_timeout:
                raise SystemExit(f"ref server at {cfg.ref_url} has not answered for {cfg.peer_timeout:.0f} s "
                                 f"({type(e).__name__}): is `python ref_server.py` running?") from None
            time.sleep(1.0)


def post_group(cfg, tensors, meta):
    """A group to the ref server: safetensors bytes, the meta JSON in their header (nothing is unpickled)."""
    header = {"json": json.dumps({"version": 2, **meta})}  # version 2 of the wire format
    body, start = save_message({name: t.contiguous() for name, t in tensors.items()}, header), time.time()
    while ref_request(cfg, "POST", "/upload", data=body).status_code == 503:  # 503: its queue is full
        if time.time() - start > cfg.data_timeout:
            raise SystemExit(f"ref server at {cfg.ref_url} stayed full for {cfg.data_timeout:.0f} s")
        time.sleep(0.1)


def take_group(cfg, run_id, deadline_s, worker):
    """This run's oldest finished group, (tensors, meta) with ref_logps (G, C_q) added. Stops the run if none
    comes in deadline_s seconds, or if the generation process dies meanwhile."""
    start = time.time()
    while (r := ref_request(cfg, "GET", "/get", params={"run_id": run_id, "wait": 2})).status_code != 200:
        if worker is not None and not worker.is_alive():  # 204: none yet (the server waited 2 s for one)
            raise SystemExit(f"the generation process (vLLM) died, exit code {worker.exitcode}: see its log")
        if time.time() - start > deadline_s:
            raise SystemExit(f"no group came in {deadline_s:.0f} s: see vLLM's log (above) and the server's")
    header = json.loads(r.content[8:8 + int.from_bytes(r.content[:8], "little")])  # safetensors' own
    return load_message(r.content), json.loads(header["__metadata__"]["json"])


# ---------------------------------------------------------------------------- the generation process
def vllm_args(cfg, shared_gpu, stop_ids):
    """vLLM's engine and sampling: G completions a prompt, each to its first stop token, log-probs at T."""
    on_gpu = torch.cuda.is_available()
    engine = dict(model=cfg.model, dtype=cfg.dtype, seed=cfg.seed, tensor_parallel_size=1,
                  enforce_eager=not on_gpu, max_model_len=cfg.max_model_len,
                  gpu_memory_utilization=cfg.gen_memory or (0.9 if on_gpu and not shared_gpu else 0.3),
                  logprobs_mode="processed_logprobs", max_num_seqs=cfg.batch_prompts * cfg.num_generations,
                  **({} if on_gpu else {"block_size": 32}))  # on a CPU: G completions share whole KV blocks
    sampling = dict(n=cfg.num_generations, temperature=cfg.temperature, max_tokens=cfg.max_new_tokens,
                    logprobs=0, stop_token_ids=stop_ids, detokenize=False,  # token ids, no text
                    **({"min_tokens": cfg.min_new_tokens} if cfg.min_new_tokens else {}))
    return engine, sampling


def gen_worker(cfg, run_id, world, shared_gpu, weights_queue):
    """The generation process. Batch b (rank b % world trains it at step b // world + 1) is sampled with the
    weights of step b // world - 1 (at first, the start's): one step ahead of the trainer."""
    if not torch.cuda.is_available():  # on a CPU: the last core, not the trainer's
        os.sched_setaffinity(0, [max(os.sched_getaffinity(0))])
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: it dies with the trainer, however
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its weights are at hand
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm import LLM, SamplingParams
    tokenizer, problems, G = AutoTokenizer.from_pretrained(cfg.model), load_problems(cfg), cfg.num_generations
    stop_ids, pad_id = stop_token_ids(tokenizer, cfg.model), tokenizer.pad_token_id
    engine_args, sampling_args = vllm_args(cfg, shared_gpu, stop_ids)
    llm, params = LLM(**engine_args), SamplingParams(**sampling_args)
    rng = random.Random(cfg.seed)  # the problem draws
    version, batch_index = 0, 0  # vLLM holds the weights after step `version`; the batch it samples next
    while True:
        # GRPO 5. (vLLM's half) before a batch, load the weights it samples with, from shared memory
        while version < batch_index // world - 1:
            version, weights = weights_queue.get()  # the state dict after step `version`
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})
            llm.reset_prefix_cache()  # it held the old weights' keys and values

        # GRPO 1. sample G completions per problem, with their log-probs; each ends at its first stop token
        t0 = time.time()
        problems_now = rng.sample(problems, cfg.batch_prompts)
        prompts = [make_prompt(tokenizer, p["question"]) for p in problems_now]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        completions = [c for out in outputs for c in out.outputs]
        completion_ids = pad_sequence([torch.tensor(c.token_ids) for c in completions], True, pad_id)  # (B,C)
        sampler_logps = pad_sequence([torch.tensor([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
                                      for c in completions], True, NO_LOGP)  # (B, C): log pi_vLLM
        lengths = (sampler_logps != NO_LOGP).sum(1)  # (B,) tokens generated, the first stop token the last
        texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
        gen_s = time.time() - t0

        # GRPO 2. score them; each one's advantage within its group; drop the groups whose rewards all agree
        scores = [score(text, problems_now[i // G]["answer"]) for i, text in enumerate(texts)]
        rewards = torch.tensor([s["reward"] for s in scores])             # (B,)
        advantages = group_advantages(rewards, G, eps=cfg.advantage_eps)  # (B,) (r - mean) / (std + eps)
        has_signal = groups_with_signal(advantages, G)                    # (Q,) some advantage is not 0
        kept = torch.nonzero(has_signal).flatten().tolist()               # the groups posted
        figures = {"reward_mean": rewards.mean().item(), "reward_std": rewards.std().item(),
                   "accuracy": sum(s["correctness"] for s in scores) / len(scores),
                   "format_rate": sum(s["format"] for s in scores) / len(scores),
                   "completion_len": lengths.float().mean().item(),
                   "truncated_frac": sum(c.finish_reason == "length" for c in completions) / len(completions),
                   "zero_var_frac": 1 - has_signal.float().mean().item(), "gen_s": gen_s}
        meta = {"policy_version": version, "temperature": cfg.temperature, "groups_in_batch": len(kept),
                "rollout_figures": figures, "stop_ids": stop_ids, "run_id": f"{run_id}-{batch_index % world}"}
        for q in kept:  # each to the ref server, which adds ref_logps (G, C_q)
            rows, C_q = slice(q * G, (q + 1) * G), int(lengths[q * G:(q + 1) * G].max())
            group = {"prompt_ids": torch.tensor(outputs[q].prompt_token_ids), "rewards": rewards[rows],
                     "advantages": advantages[rows], "completion_ids": completion_ids[rows, :C_q],
                     "sampler_logps": sampler_logps[rows, :C_q]}
            post_group(cfg, group, meta)
        batch_index += bool(kept)  # none kept: new problems for the same batch


def start_gen_worker(cfg, run_id, world):
    """The generation process, a daemon (it ends with the trainer), on a GPU or the last CPU core."""
    ctx, shared_gpu = torch.multiprocessing.get_context("spawn"), False
    env = {"OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}  # idle threads sleep
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(local)))
        trainer_gpus = [int(gpu) for gpu in visible.split(",")[:local]]
        gpu = cfg.gen_device if cfg.gen_device >= 0 else max(trainer_gpus) + 1
        env.update(CUDA_VISIBLE_DEVICES=str(gpu), CUDA_DEVICE_ORDER="PCI_BUS_ID")
        shared_gpu = gpu in trainer_gpus
    elif cfg.gen_device != -1 or cfg.gen_memory:
        raise SystemExit("--gen_device and --gen_memory place vLLM on a GPU, and this machine has none")
    else:
        env["OMP_NUM_THREADS"] = "1"  # and the last core (gen_worker)
    weights_queue = ctx.Queue()
    worker = ctx.Process(target=gen_worker, args=(cfg, run_id, world, shared_gpu, weights_queue), daemon=True)
    with mock.patch.dict(os.environ, env):  # the new process starts with this environment
        worker.start()
    return worker, weights_queue


# ---------------------------------------------------------------------------- the trainer
def collate(groups, pad_id):
    """One batch: prompt_ids and prompt_mask (Q, P), a left-padded row per group; completion_ids,
    sampler_logps and ref_logps (B, C), right-padded, the groups one after another; advantages (B,)."""
    prompts = [g["prompt_ids"] for g in groups]
    batch = {"prompt_ids": pad_sequence(prompts, True, pad_id, "left"),
             "prompt_mask": pad_sequence([torch.ones_like(p) for p in prompts], True, 0, "left"),
             "advantages": torch.cat([g["advantages"] for g in groups])}
    for key, pad in (("completion_ids", pad_id), ("sampler_logps", NO_LOGP), ("ref_logps", 0.0)):
        batch[key] = pad_sequence([row for g in groups for row in g[key]], True, pad)
    return batch


def grpo_step(engine, batch, loss_mask, cfg):
    """The policy's log-probs, the loss (pi_old: those log-probs, detached; vLLM's weight each token), one
    optimizer step. Returns the whole batch's figures, summed over the ranks, and the log-probs (B, C)."""
    logps, entropy = completion_logps(engine, batch["prompt_ids"], batch["prompt_mask"],
                                      batch["completion_ids"], cfg.temperature)  # (B, C) each
    # each rank divides by the whole batch's count (its sequences), summed over the ranks before any clamp,
    # times the ranks: DeepSpeed averages the ranks' gradients into the whole batch's
    world, n = dist.get_world_size(), loss_mask.sum().item()
    counts = torch.tensor([loss_mask.size(0), n], device=engine.device)
    dist.all_reduce(counts)
    denominator, tokens = counts[0].clamp(min=1).item() / world, counts[1].clamp(min=1).item()
    loss, stats = grpo_loss(logps, logps.detach(), batch["ref_logps"], batch["advantages"], loss_mask,
                            beta=cfg.beta, epsilon=cfg.epsilon, sampler_logps=batch["sampler_logps"],
                            tis_cap=cfg.tis_cap, denominator=denominator, impl=cfg.loss_impl)
    engine.backward(loss)
    grads = [p.grad.norm() for p in engine.module.parameters() if p.grad is not None]  # ZeRO 0 (1-2: none)
    engine.step()  # clip the gradients, one AdamW step, zero them
    grad_norm = torch.stack(grads).norm().item() if grads else float(engine.get_global_grad_norm())
    # the whole batch's loss and token means: this rank's shares, summed over the ranks
    sums = torch.tensor([loss.item() / world, stats["kl"] * n, stats["clip_fraction"] * n,
                         stats["is_weight_mean"] * n, (entropy * loss_mask).sum().item()],
                        dtype=torch.float64, device=engine.device)
    dist.all_reduce(sums)
    means = dict(zip(("kl", "clip_fraction", "is_weight_mean", "entropy"), (sums[1:] / tokens).tolist()))
    return {"loss": sums[0].item(), **means, "grad_norm": grad_norm}, logps.detach()


def parse_flags():
    parser = HfArgumentParser(Config, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    cfg, unknown = parser.parse_args_into_dataclasses(return_remaining_strings=True)
    if unknown:
        raise SystemExit(f"grpo_vllm_one.py (the lesson) has no {' '.join(unknown)}: every feature beyond its"
                         f" step is the full trainer's: python -m simple_grpo.train {' '.join(sys.argv[1:])}")
    choices = {"zero_stage": (0, 1, 2), "dtype": ("float32", "bfloat16"), "loss_impl": ("torch", "triton")}
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            raise SystemExit(f"--{name} {getattr(cfg, name)}: the lesson takes only {allowed}")
    if cfg.tis_cap <= 0:  # each token's weight is min(pi_old / pi_vLLM, cap)
        raise SystemExit(f"--tis_cap {cfg.tis_cap}: the lesson takes a cap > 0; no cap: the full trainer")
    return cfg


def main(cfg):
    if "RANK" not in os.environ:  # plain `python grpo_vllm_one.py`: a job of one process (port 0: any free)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    run_dir = os.path.join(os.environ.get("SIMPLE_GRPO_RUNS", "runs"), cfg.run_name)
    if rank == 0 and os.path.isdir(run_dir) and os.listdir(run_dir) and not cfg.overwrite:
        raise SystemExit(f"{run_dir}/ holds an earlier run: --overwrite replaces it")
    load_problems(cfg)  # a bad data file stops here, before anything starts
    ref_dtype = ref_request(cfg, "GET", "/health").json()["dtype"]  # and a ref server that does not answer
    import deepspeed  # the trainer before vLLM, which sizes its cache in the memory left
    torch.set_num_threads(cfg.threads)
    random.seed(cfg.seed), torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=getattr(torch, cfg.dtype))
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = deepspeed.initialize(model=model, config=deepspeed_config(cfg))  # AdamW on its parameters
    engine.train()
    run_id = [os.urandom(16).hex()]  # a new name for this run's groups in the ref server, rank 0's for all
    dist.broadcast_object_list(run_id, src=0)
    worker, weights_queue = start_gen_worker(cfg, run_id[0], world) if rank == 0 else (None, None)
    stream = f"{run_id[0]}-{rank}"  # the ref server's queue of this rank's groups
    if rank == 0:
        shutil.rmtree(run_dir, ignore_errors=True)
        os.makedirs(run_dir)
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=1)
    bar = tqdm(range(1, cfg.steps + 1), desc="grpo_vllm_one", disable=rank != 0)
    for step in bar:
        # GRPO 3. this rank's batch: the groups vLLM sampled, each with the ref server's ref_logps (G, C_q)
        t0, deadline = time.time(), cfg.data_timeout + (cfg.startup_timeout if step == 1 else 0)
        taken = []  # [(group, meta)]: as many groups as the first one's meta says
        while not taken or len(taken) < taken[0][1]["groups_in_batch"]:
            taken.append(take_group(cfg, stream, deadline, worker))
        meta, wait_s = taken[-1][1], time.time() - t0
        batch = collate([group for group, _ in taken], tokenizer.pad_token_id)
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        lengths = (batch["sampler_logps"] != NO_LOGP).sum(1)  # (B,) the tokens vLLM generated
        loss_mask = completion_mask(batch["completion_ids"], meta["stop_ids"], lengths=lengths)  # (B, C)

        # GRPO 4. the loss on the policy's log-probs, one optimizer step (grpo_step, above)
        stats, logps = grpo_step(engine, batch, loss_mask, cfg)
        record = {"step": step, **meta["rollout_figures"], **stats, "wait_s": wait_s,
                  "compute_s": time.time() - t0 - wait_s, "policy_lag": step - 1 - meta["policy_version"]}
        if step == 1:  # the policy is still where it started, the reference: their log-probs must agree
            gap = ((logps - batch["ref_logps"]).abs() * loss_mask).sum() / loss_mask.sum().clamp(min=1)
            if gap > (1e-3 if cfg.dtype == ref_dtype == "float32" else 0.05):
                raise SystemExit(f"the ref server's log-probs are {gap:.3g} a token off ours: another model?")

        # GRPO 5. the new weights to vLLM, in memory: a copy, which torch's queue moves to shared memory
        if rank == 0 and step < cfg.steps:
            weights_queue.put((step, {k: v.to("cpu", copy=True) for k, v in model.state_dict().items()}))

        record["step_s"] = time.time() - t0
        if rank == 0:
            with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({k: float(f"{v:.6g}") if isinstance(v, float) else v
                                    for k, v in record.items()}) + "\n")
            if cfg.log_completions_every and step % cfg.log_completions_every == 0:  # the first group's
                group, prompt = taken[0][0], tokenizer.decode(taken[0][0]["prompt_ids"])
                rows = zip(tokenizer.batch_decode(group["completion_ids"], skip_special_tokens=True),
                           group["rewards"].tolist(), group["advantages"].tolist())
                with open(os.path.join(run_dir, "completions.jsonl"), "a") as f:
                    f.writelines(json.dumps({"step": step, "prompt": prompt, "completion": text, "reward": r,
                                             "advantage": a}) + "\n" for text, r, a in rows)
        bar.set_postfix(reward=record["reward_mean"], acc=record["accuracy"], kl=record["kl"])
        if (step % cfg.save_every == 0 or step == cfg.steps) and rank == 0:  # ZeRO 0-2: weights whole
            engine.module.save_pretrained(os.path.join(run_dir, f"step_{step}"))
            tokenizer.save_pretrained(os.path.join(run_dir, f"step_{step}"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_flags())
