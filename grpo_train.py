r"""grpo_train.py: the simplest GRPO trainer: one process, and the policy samples for itself. Read it with
grpo_math.py (the math) and ref_server.py (the reference); grpo_vllm_one.py is its step with vLLM sampling.
`# GRPO n.` marks the algorithm, the rest is plumbing. Hub datasets, LoRA, resume, several ranks and the loss
variants are the full trainer's: python -m simple_grpo.train --help. Q problems, G completions each, B = Q*G.

    python ref_server.py &          # the frozen reference model (the tiny default), on 127.0.0.1
    python grpo_train.py            # make demo TRAINER=grpo_train: the tiny model and the toy task, on CPU
    python grpo_train.py --beta 0   # no KL term: no reference server at all
    python ref_server.py --model Qwen/Qwen2.5-0.5B --device cuda:0 &
    deepspeed --num_gpus 1 grpo_train.py --model Qwen/Qwen2.5-0.5B --dtype bfloat16
"""
import json
import os
import random
import re
import shutil
import sys
import time
import uuid
from argparse import RawDescriptionHelpFormatter
from dataclasses import asdict, dataclass, field

import requests
import torch
from safetensors.torch import load as load_message, save as save_message
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, HfArgumentParser

from grpo_math import (completion_logps, completion_mask, group_advantages, groups_with_signal, grpo_loss,
                       is_truncated)


def flag(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    model: str = flag("models/tiny-math", "the policy's starting point: an HF model directory or hub name")
    dataset: str = flag("data/toy_math/train.jsonl", "problems: a .jsonl file of GSM8K's question and answer")
    steps: int = flag(200, "training steps: a batch of groups and one optimizer step each")
    batch_prompts: int = flag(8, "problems sampled per step: Q")
    num_generations: int = flag(8, "completions per problem: the group size G")
    max_new_tokens: int = flag(48, "the longest completion, in tokens")
    min_new_tokens: int = flag(0, "no stop token before this many tokens (benchmarks at a fixed length)")
    temperature: float = flag(0.7, "sampling temperature; the log-probs are taken at it too")
    advantage_eps: float = flag(1e-4, "added to a group's reward std: equal rewards give 0, not 0/0")
    beta: float = flag(0.04, "weight of the KL penalty to the reference model; 0: no ref server")
    epsilon: float = flag(0.2, "PPO clip range: the ratio is clipped to [1 - epsilon, 1 + epsilon]")
    lr: float = flag(0.0, "AdamW's learning rate; 0: 1e-4 for the tiny default model, 1e-6 for others")
    max_grad_norm: float = flag(1.0, "the gradients' global 2-norm is clipped to this before each step")
    ref_url: str = flag("http://127.0.0.1:59875", "the reference server (python ref_server.py)")
    ref_token: str = flag("", "the ref server's shared token, if it has one (default: $SIMPLE_GRPO_TOKEN)")
    dtype: str = flag("float32", "float32, or bfloat16 (GPUs)")
    zero_stage: int = flag(0, "DeepSpeed's ZeRO stage: 0, 1 or 2 (3: the full trainer)")
    gradient_checkpointing: bool = flag(False, "recompute activations in backward: less memory, more compute")
    run_name: str = flag("demo", "outputs go to runs/RUN_NAME/ (or $SIMPLE_GRPO_RUNS/RUN_NAME/)")
    overwrite: bool = flag(False, "replace runs/RUN_NAME/ if an earlier run used it (it is deleted)")
    save_every: int = flag(100, "steps between checkpoints (HF format; one at the end too)")
    log_completions_every: int = flag(10, "every N steps, one group's completions to completions.jsonl")
    seed: int = flag(0, "seed of the problem draws, the sampling and the trainer")
    threads: int = flag(2, "the trainer's CPU threads")
    ref_timeout: float = flag(120.0, "seconds to wait for a group back from the ref server")
    peer_timeout: float = flag(30.0, "seconds the ref server may take to answer before the run stops")
    local_rank: int = flag(-1, "set by the deepspeed launcher")


def parse_flags(args=None):
    parser = HfArgumentParser(Config, description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    cfg, unknown = parser.parse_args_into_dataclasses(args=args, return_remaining_strings=True)
    if unknown:
        raise SystemExit(f"grpo_train.py has no {' '.join(unknown)}: every feature beyond its step is the"
                         f" full trainer's: python -m simple_grpo.train {' '.join(args or sys.argv[1:])}")
    for name, allowed in {"zero_stage": (0, 1, 2), "dtype": ("float32", "bfloat16")}.items():
        if (value := getattr(cfg, name)) not in allowed:
            raise SystemExit(f"--{name} {value}: grpo_train.py takes {allowed} (the full trainer: more)")
    tiny = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "tiny-math"))
    cfg.lr = cfg.lr or (1e-4 if os.path.realpath(cfg.model) == tiny else 1e-6)
    return cfg


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


def load_problems(cfg):
    """[{"question", "answer"}] from the .jsonl file; each answer ends "#### N", as GSM8K's do."""
    try:
        with open(cfg.dataset, encoding="utf-8") as f:
            problems = [{"question": row["question"], "answer": row["answer"]}
                        for row in map(json.loads, filter(str.strip, f))]
    except (OSError, ValueError, KeyError, TypeError) as e:  # no such file, not JSON, no such field
        raise SystemExit(f"--dataset {cfg.dataset}: {type(e).__name__} {str(e)[:200]}") from None
    if bad := [i for i, p in enumerate(problems, 1) if "####" not in str(p["answer"])]:
        raise SystemExit(f"--dataset {cfg.dataset}: row {bad[0]}'s answer has no '#### N' line (GSM8K's)")
    return problems


def make_prompt(tokenizer, question):
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def stop_token_ids(tokenizer, model):
    """The one stop set, generate's and the masks': EOS, the chat template's turn end, generation_config's."""
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
    """One HTTP call to the ref server; one it does not answer in --peer_timeout seconds stops the run."""
    token = cfg.ref_token or os.environ.get("SIMPLE_GRPO_TOKEN", "")
    try:
        r = requests.request(method, cfg.ref_url + path, timeout=cfg.peer_timeout,
                             headers={"Authorization": f"Bearer {token}"} if token else {}, **kw)
    except requests.RequestException as e:
        raise SystemExit(f"ref server at {cfg.ref_url} has not answered ({type(e).__name__}): is `python"
                         " ref_server.py` running?") from None
    if r.status_code not in (200, 204):  # 204: no group finished yet
        raise SystemExit(f"ref server at {cfg.ref_url}{path}: HTTP {r.status_code} {r.text[:200]}")
    return r


def post_group(cfg, tensors, meta):
    """A group to the ref server: safetensors bytes, the meta JSON in their header (nothing is unpickled)."""
    body = save_message({k: v.contiguous() for k, v in tensors.items()},
                        {"json": json.dumps({"version": 2, **meta})})  # version 2 of the format
    ref_request(cfg, "POST", "/upload", data=body)


def take_group(cfg, run_id, deadline_s):
    """This run's oldest finished group, (tensors, meta), with ref_logps (G, C) added, within deadline_s."""
    start = time.time()
    while (r := ref_request(cfg, "GET", "/get", params={"run_id": run_id, "wait": 2})).status_code != 200:
        if time.time() - start > deadline_s:
            raise SystemExit(f"no group came back from the ref server in {deadline_s:.0f} s: see its log")
    header = json.loads(r.content[8:8 + int.from_bytes(r.content[:8], "little")])
    return load_message(r.content), json.loads(header["__metadata__"]["json"])


# ---------------------------------------------------------------------------- sampling and the update
def generate(model, tokenizer, prompts, cfg, stop_ids):
    """G completions per prompt from softmax(logits / T) (a blank GenerationConfig: no top-k, top-p or penalty
    of the model's), each to its first stop token: prompt_ids, prompt_mask (Q, P), completion_ids (B, C)."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left",
                    add_special_tokens=False).to(model.device)
    ids, mask, G = enc["input_ids"], enc["attention_mask"], cfg.num_generations
    model.eval()  # sampling draws from the policy as it is: no dropout
    own_config, model.generation_config = model.generation_config, GenerationConfig()
    with torch.no_grad():  # each prompt runs once (but its last token); generate gets G copies of its cache
        positions = (mask[:, :-1].cumsum(1) - 1).clamp(min=0)  # count real tokens only, as generation does
        cache = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions,
                      use_cache=True, logits_to_keep=1).past_key_values
        cache.batch_repeat_interleave(G)
        out = model.generate(input_ids=ids.repeat_interleave(G, 0), past_key_values=cache,
                             attention_mask=mask.repeat_interleave(G, 0), do_sample=True, top_k=0, top_p=1.0,
                             temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                             min_new_tokens=cfg.min_new_tokens, eos_token_id=stop_ids,
                             pad_token_id=tokenizer.pad_token_id)
    model.generation_config = own_config
    model.train()
    return ids, mask, out[:, ids.size(1):]  # (Q, P), (Q, P), (B, C)


def grpo_step(engine, batch, loss_mask, cfg):
    """The policy's log-probs, the loss, one optimizer step. pi_old is the policy's own log-probs, detached
    (it sampled them: the ratio is 1, only its gradient counts). Returns the figures, the log-probs (B, C)."""
    logps, entropy = completion_logps(engine, batch["prompt_ids"], batch["prompt_mask"],
                                      batch["completion_ids"], cfg.temperature)  # (B, C) each
    # grpo_loss's default denominator: each sequence's token mean, then the mean over the batch's sequences
    loss, stats = grpo_loss(logps, logps.detach(), batch.get("ref_logps"), batch["advantages"], loss_mask,
                            beta=cfg.beta, epsilon=cfg.epsilon)
    engine.backward(loss)
    grads = [p.grad.norm() for p in engine.module.parameters() if p.grad is not None]  # ZeRO 0: whole here
    engine.step()  # clip the gradients, one AdamW step, zero them
    grad_norm = torch.stack(grads).norm() if grads else engine.get_global_grad_norm()  # ZeRO 1-2: DeepSpeed's
    entropy = (entropy * loss_mask).sum().item() / loss_mask.sum().clamp(min=1).item()
    return {"loss": loss.item(), **stats, "entropy": entropy, "grad_norm": float(grad_norm)}, logps.detach()


def main(cfg):
    if (world := int(os.environ.get("WORLD_SIZE", "1"))) > 1:
        raise SystemExit(f"{world} ranks: grpo_train.py runs one, python -m simple_grpo.train several:"
                         f" deepspeed --num_gpus {world} --module simple_grpo.train")
    for k, v in dict(RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=0).items():
        os.environ.setdefault(k, str(v))  # plain `python grpo_train.py`: a job of one process
    run_dir = os.path.join(os.environ.get("SIMPLE_GRPO_RUNS", "runs"), cfg.run_name)
    if os.path.isdir(run_dir) and os.listdir(run_dir) and not cfg.overwrite:
        raise SystemExit(f"{run_dir}/ holds a run: --overwrite replaces it (--resume: the full trainer's)")
    problems = load_problems(cfg)  # a bad data file, or a ref server that does not answer, stops the run here
    ref_dtype = ref_request(cfg, "GET", "/health").json()["dtype"] if cfg.beta != 0 else None
    import deepspeed
    torch.set_num_threads(cfg.threads)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=getattr(torch, cfg.dtype))
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=deepspeed_config(cfg))
    engine.train()
    torch.manual_seed(cfg.seed)  # the sampling's draws (and dropout's, for a model that has it)
    rng, run_id, G = random.Random(cfg.seed), uuid.uuid4().hex, cfg.num_generations  # rng: the problem draws
    stop_ids = stop_token_ids(tokenizer, cfg.model)
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(asdict(cfg), f, indent=1)
    for step in (bar := tqdm(range(1, cfg.steps + 1), desc="grpo_train")):
        # GRPO 1. sample G completions per problem with the policy itself; each ends at its first stop token
        t0 = time.time()
        problems_now = rng.sample(problems, cfg.batch_prompts)
        prompts = [make_prompt(tokenizer, p["question"]) for p in problems_now]
        prompt_ids, prompt_mask, completion_ids = generate(engine.module, tokenizer, prompts, cfg, stop_ids)
        until_stop = completion_mask(completion_ids, stop_ids)  # (B, C) 1 up to and with the stop token
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)  # generate pads after a stop
        gen_s, lengths = time.time() - t0, until_stop.sum(1)  # lengths (B,)
        # GRPO 2. score them; each one's advantage within its group; drop the groups whose rewards all agree
        scores = [score(text, problems_now[i // G]["answer"]) for i, text in enumerate(texts)]
        rewards = torch.tensor([s["reward"] for s in scores])             # (B,)
        advantages = group_advantages(rewards, G, eps=cfg.advantage_eps)  # (B,) (r - mean) / (std + eps)
        has_signal = groups_with_signal(advantages, G)                    # (Q,) some advantage is not 0
        kept, rows = torch.nonzero(has_signal).flatten().tolist(), has_signal.repeat_interleave(G)  # (B,)
        record = {"step": step, "reward_mean": rewards.mean().item(), "reward_std": rewards.std().item(),
                  "accuracy": sum(s["correctness"] for s in scores) / len(scores),
                  "format_rate": sum(s["format"] for s in scores) / len(scores),
                  "completion_len": lengths.float().mean().item(),
                  "truncated_frac": is_truncated(completion_ids, stop_ids).float().mean().item(),
                  "zero_var_frac": 1 - has_signal.float().mean().item(), "gen_s": gen_s,
                  "tokens_per_s": lengths.sum().item() / gen_s,  # no update: its figures null
                  "loss": None, "kl": None, "clip_fraction": None, "ratio_mean": None, "grad_norm": None}
        batch = {"prompt_ids": prompt_ids[has_signal], "prompt_mask": prompt_mask[has_signal],  # (Q_kept, P)
                 "completion_ids": completion_ids[rows], "advantages": advantages[rows]}  # (B_kept, C)
        loss_mask, t1 = until_stop[rows], time.time()  # (B_kept, C)
        if kept and cfg.beta != 0:
            # GRPO 3. the reference's log-probs of the kept groups: each to the ref server, and back with them
            meta = {"run_id": run_id, "policy_version": step - 1, "temperature": cfg.temperature}
            for q in kept:  # the prompt without its padding, the completions cut after the group's longest
                C_q = int(lengths[q * G:(q + 1) * G].max())
                post_group(cfg, {"prompt_ids": prompt_ids[q][prompt_mask[q].bool()],
                                 "completion_ids": completion_ids[q * G:(q + 1) * G, :C_q]}, meta)
            C = completion_ids.size(1)  # each group's ref_logps (G, C_q), in the order posted, 0 after C_q
            groups = [take_group(cfg, run_id, cfg.ref_timeout)[0]["ref_logps"] for _ in kept]
            batch["ref_logps"] = torch.cat([torch.nn.functional.pad(r, (0, C - r.size(1))) for r in groups])
        t2 = time.time()
        if kept:
            # GRPO 4. the loss on the policy's log-probs, one optimizer step (grpo_step, above)
            stats, logps = grpo_step(engine, batch, loss_mask, cfg)
            record.update(stats)
            if engine.global_steps == 1 and cfg.beta != 0:  # the first update: the policy was the reference
                gap = ((logps - batch["ref_logps"]).abs() * loss_mask).sum() / loss_mask.sum().clamp(min=1)
                if gap > (1e-3 if cfg.dtype == ref_dtype == "float32" else 0.05):
                    raise SystemExit(f"the ref server's log-probs are {gap:.3g} a token from ours: it serves"
                                     f" another model than {cfg.model} (ref_server.py --model {cfg.model}?)")
        record.update(ref_s=t2 - t1, compute_s=time.time() - t2, step_s=time.time() - t0)
        record = {k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in record.items()}  # 6 digits
        with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
            print(json.dumps(record), file=f)
        if kept and cfg.log_completions_every and step % cfg.log_completions_every == 0:  # 1st kept group
            with open(os.path.join(run_dir, "completions.jsonl"), "a") as f:
                for i in range(kept[0] * G, (kept[0] + 1) * G):
                    print(json.dumps(dict(step=step, prompt=prompts[kept[0]], completion=texts[i],
                                          reward=rewards[i].item(), advantage=advantages[i].item())), file=f)
        bar.set_postfix(reward=record["reward_mean"], acc=record["accuracy"], kl=record["kl"])
        if step % cfg.save_every == 0 or step == cfg.steps:  # ZeRO 0-2: the weights are whole here
            engine.module.save_pretrained(os.path.join(run_dir, f"step_{step}"))
            tokenizer.save_pretrained(os.path.join(run_dir, f"step_{step}"))
    print(f"done: {run_dir}/step_{cfg.steps}; its page: python tools/view_run.py {run_dir}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(parse_flags())
