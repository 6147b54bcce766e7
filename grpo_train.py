"""grpo_train.py: the simplest complete GRPO trainer.

    python ref_server.py &          # the frozen reference model, 127.0.0.1:59875
    python grpo_train.py            # tiny default model and toy task, on CPU
    deepspeed grpo_train.py --model Qwen/Qwen2.5-0.5B --dataset openai/gsm8k --dataset_config main
    python grpo_train.py --beta 0           # no KL term: no reference server at all

Every step, in order:
  1. sample `batch_prompts` problems and generate `num_generations` completions for each
     with the policy itself (transformers generate, KV cache, temperature sampling);
  2. score them (rewards.py) and form group-relative advantages; groups whose rewards
     are all equal teach nothing (every advantage is 0) and are dropped;
  3. post the groups to the reference server and take them back with reference log-probs;
  4. compute the GRPO loss (grpo_math.py) and take an optimizer step with DeepSpeed.
It writes one JSON line per step to runs/NAME/metrics.jsonl, checkpoints to runs/NAME/step_N/
(HF format, plus the state --resume continues from), and the curves to runs/NAME/curves.png.
"""
import math
import os
import random
import time
import uuid
from dataclasses import dataclass
from typing import Optional

import torch
from tqdm import tqdm

from checkpoint import check_run_dir, open_run, save_checkpoint
from completions_log import log_batch_completions
from data import make_prompt, stop_token_ids
from devices import max_over_ranks
from doctor import RunDoctor, batch_summary, parse_stop_on
from ds_config import deepspeed_config, uses_bf16, zero_stage
from engine import grad_norm, make_engine
from flags import flag, parse_flags
from grpo_math import LOSS_TYPES, completion_mask, grpo_loss, is_truncated, prefill_prompts, sequence_logps
from memory_plan import show_plan
from metrics import Tracker, add_part_stats, log_step
from preflight import preflight
from protocol import post_groups, ref_request, take_group
from report import finish_run
from rollouts import collate, make_groups, rollout_stats, score_groups
from task import TaskConfig, check_task, load_data


@dataclass
class Config(TaskConfig):
    SECTIONS = {"model": "model and data", "num_generations": "sampling", "beta": "objective (grpo_math.py)",
                "lr": "optimisation", "zero_stage": "systems", "run_name": "output", "stop_on": "the run doctor"}
    batch_prompts: int = flag(8, "problems per step")
    beta: float = flag(0.04, "weight of the KL penalty to the reference model; 0: no reference server")
    kl_estimator: str = flag("k3", "k1, k2 or k3 (grpo_math.kl_estimate)")
    epsilon: float = flag(0.2, "PPO clip range: the ratio is clipped to [1 - epsilon, 1 + epsilon_high]")
    epsilon_high: Optional[float] = flag(None, "upper clip (default: epsilon; 0.28 for dapo, 4.0 for cispo)")
    loss_type: str = flag("grpo", "grpo, bnpo, dr_grpo, dapo or cispo: how tokens are averaged (grpo_math.aggregate)")
    importance_sampling_level: str = flag("token", "token, or sequence (GSPO)")
    scale_rewards: str = flag("", "advantage scale: group, batch or none (default: group; none for dr_grpo)")
    mask_truncated_completions: bool = flag(False, "completions cut off without a stop token get no gradient")
    lr: float = flag(1e-6, "Adam's learning rate; 1e-6 (TRL's) suits pretrained models, the tiny demo takes 1e-4")
    steps: int = flag(200, "optimizer steps (one batch of rollouts each)")
    num_iterations: int = flag(1, "optimizer steps per batch of rollouts (TRL's num_iterations, PPO's epochs)")
    micro_batch_groups: int = flag(0, "groups per forward/backward (0: the whole batch); less memory, same step")
    zero_stage: int = flag(0, "DeepSpeed ZeRO stage (0-3)")
    dtype: str = flag("float32", "float32, or bfloat16 (bf16 weights and activations, fp32 master weights and Adam)")
    gradient_checkpointing: bool = flag(False, "recompute activations in backward: less memory, ~1/3 more compute")
    offload_optimizer: bool = flag(False, "ZeRO-1/2/3: optimizer state and fp32 master weights in host RAM")
    deepspeed: str = flag("", "a whole DeepSpeed config (JSON): its values win over these flags, 'auto' takes theirs")
    loss_impl: str = flag("torch", "triton: fused kernels (triton_loss/), the same numbers; torch where Triton can't")
    plan: bool = flag(False, "print the memory plan (memory_plan.py) and exit")
    plan_gpu_gb: float = flag(0.0, "the GPU size to plan for (0: this machine's GPU)")
    threads: int = flag(2, "CPU threads for torch")
    ref_url: str = flag("http://127.0.0.1:59875", "the reference server (python ref_server.py)")
    ref_token: str = flag("", "the ref server's shared token, if it has one (default: $SIMPLE_GRPO_TOKEN)")
    ref_timeout: float = flag(120.0, "seconds to wait for a finished group, or for room in a full queue")
    peer_timeout: float = flag(30.0, "seconds the ref server may not answer at all before the run stops")
    local_rank: int = flag(-1, "set by the deepspeed launcher")
    run_name: str = flag("demo", "outputs go to runs/RUN_NAME/")
    save_every: int = flag(100, "steps between checkpoints (and one at the end)")
    resume: bool = flag(False, "continue runs/RUN_NAME from its latest checkpoint")
    overwrite: bool = flag(False, "replace runs/RUN_NAME if an earlier run used it (its checkpoints are deleted)")
    log_completions_every: int = flag(10, "every N steps, one group's completions to completions.jsonl (0: never)")
    report_to: str = flag("none", "none, tensorboard or wandb: send the metrics there too (metrics.jsonl stays)")
    preflight: bool = flag(False, "first probe preflight_n problems (tools/probe.py); stop if no group has signal")
    preflight_n: int = flag(64, "problems the pre-flight probe samples")
    stop_on: str = flag("", "doctor rules that stop the run: no_signal, kl, entropy, truncated, mismatch, ratio")
    doctor_window: int = flag(10, "batches in a row with no signal (no_signal); steps the other rules average")
    doctor_kl_max: float = flag(5.0, "kl: KL to the reference above this (the tiny demo peaks near 1.3)")
    doctor_kl_jump: float = flag(20.0, "kl: or above 1 and this many times its mean over the window before")
    doctor_entropy_drop: float = flag(0.1, "entropy: the window's mean below this fraction of the first window's")
    doctor_truncated_max: float = flag(0.5, "truncated: more than this share of completions cut off")
    doctor_gap_max: float = flag(0.1, "mismatch: vLLM vs trainer log-prob gap per token (bf16 SmolLM2: ~0.03)")
    doctor_ratio_band: float = flag(0.1, "ratio: the window's mean importance ratio further than this from 1")


def check_options(cfg):
    """Fill in the defaults that depend on other options and reject bad values early, before
    the slow start-up. Returns the reward weights {name: weight} (a reward file adds names)."""
    if cfg.loss_type not in LOSS_TYPES:
        raise SystemExit(f"unknown --loss_type {cfg.loss_type!r}: use one of {', '.join(LOSS_TYPES)}")
    if cfg.epsilon_high is None:
        cfg.epsilon_high = {"dapo": 0.28, "cispo": 4.0}.get(cfg.loss_type, cfg.epsilon)
    cfg.scale_rewards = cfg.scale_rewards or ("none" if cfg.loss_type == "dr_grpo" else "group")
    for name, allowed in (("scale_rewards", ("group", "batch", "none")), ("kl_estimator", ("k1", "k2", "k3")),
                          ("importance_sampling_level", ("token", "sequence"))):
        if getattr(cfg, name) not in allowed:
            raise SystemExit(f"unknown --{name} {getattr(cfg, name)!r}: use one of {', '.join(allowed)}")
    reward_weights = check_task(cfg)  # the model, data, reward and sampling flags (task.py)
    parse_stop_on(cfg.stop_on)
    Tracker.check(cfg.report_to)
    # the DeepSpeed config, once: a --deepspeed file can change the stage, dtype and lr the rest reads
    ds_config, notes = deepspeed_config(cfg, type(cfg)())
    for note in notes:
        print(note)
    cfg.zero_stage, cfg.dtype = zero_stage(ds_config), "bfloat16" if uses_bf16(ds_config) else "float32"
    cfg.lr = ds_config.get("optimizer", {}).get("params", {}).get("lr", cfg.lr)
    return reward_weights


# ---------------------------------------------------------------------------- rollouts
def generate(model, tokenizer, prompts, cfg, stop_ids, synced_gpus=False):
    """Sample G completions per prompt, each ending at the first of stop_ids. Returns prompt_ids
    (Q, P) left-padded with its mask, and completion_ids (Q*G, C) right-padded with pad, group after group."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left",
                    add_special_tokens=False).to(model.device)
    ids, mask, G = enc["input_ids"], enc["attention_mask"], cfg.num_generations
    model.eval()
    with torch.no_grad():
        # the G samples of a prompt share it: run each prompt once (all but its last token, which
        # generate feeds itself) and hand generate G copies of its KV cache
        cache = prefill_prompts(model, ids[:, :-1], mask[:, :-1], G).past_key_values
        out = model.generate(input_ids=ids.repeat_interleave(G, 0), attention_mask=mask.repeat_interleave(G, 0),
                             past_key_values=cache, do_sample=True, temperature=cfg.temperature, top_k=0,
                             top_p=1.0, max_new_tokens=cfg.max_new_tokens, min_new_tokens=cfg.min_new_tokens,
                             eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id,
                             synced_gpus=synced_gpus)
    model.train()
    return ids, mask, out[:, ids.size(1):]


# ---------------------------------------------------------------------------- the reference server
def get_ref_logps(cfg, groups, run_id, bar):
    """Post each group, take the finished groups back (FIFO) with ref_logps added; the bar says so."""
    bar.set_description_str(f"posting {len(groups)} groups to the ref server")
    post_groups(cfg, groups)
    finished = []
    for i in range(len(groups)):
        def waiting(waited_s):
            bar.set_description_str(f"waiting for the ref server's log-probs: group {i + 1}/{len(groups)} "
                                    f"({waited_s:.0f} s, gives up after {cfg.ref_timeout:.0f} s)")
        finished.append(take_group(cfg, run_id, cfg.ref_timeout, waiting)[0])
    bar.set_description_str("grpo")
    return finished


# ---------------------------------------------------------------------------- the update
def grpo_update(engine, batch, cfg, stop_ids, weight=1.0):
    """The GRPO update on one collated batch: the loss's diagnostics, and the per-token log-probs.

    old_logps are the current policy's own log-probs (ratio 1 on the first iteration). When
    another engine sampled (vLLM, batch["old_logps"]: its own log-probs, of an older policy in
    another precision), its numbers weight each token by truncated importance sampling (cfg.tis_cap;
    grpo_math.truncated_is_weight), or, with tis_cap 0, stand in for the old policy's in the ratio.
    num_iterations > 1 takes several steps on the same rollouts (PPO's epochs): from the
    second on, the ratio moves off 1 and the clip bounds the update. With micro_batch_groups,
    forward and backward go a few groups at a time and the gradients add up to the whole
    batch's (each part's loss weighted by its share), for one optimizer step. weight 0: take part
    in the step's collectives (several ranks) with no gradient of one's own. Returns the stats and
    the last iteration's per-token log-probs (for the completions log)."""
    batch = {k: v.to(engine.device) for k, v in batch.items()}
    mask = completion_mask(batch["completion_ids"], stop_ids, cfg.mask_truncated_completions)
    Q = batch["prompt_ids"].size(0)
    G, per_part = batch["completion_ids"].size(0) // Q, cfg.micro_batch_groups or Q
    parts = [(q, min(q + per_part, Q)) for q in range(0, Q, per_part)]
    token_mean = cfg.loss_type in ("bnpo", "dapo", "cispo")  # the others average over sequences first
    old_logps, sampler_logps, skipped, norm = batch.get("old_logps"), None, 0, None
    tis_cap = getattr(cfg, "tis_cap", 0.0)  # grpo_vllm_one's option: only it has a sampler of its own
    if old_logps is not None and tis_cap > 0:
        old_logps, sampler_logps = None, old_logps
    for _ in range(cfg.num_iterations):
        loss, stats, new_logps, entropy = 0.0, {}, [], 0.0
        for i, (q0, q1) in enumerate(parts):
            rows = slice(q0 * G, q1 * G)
            logps, part_entropy = sequence_logps(engine, batch["prompt_ids"][q0:q1], batch["prompt_mask"][q0:q1],
                                                 batch["completion_ids"][rows], cfg.temperature, impl=cfg.loss_impl,
                                                 entropy=True)
            new_logps.append(logps.detach())
            ref = batch["ref_logps"][rows] if "ref_logps" in batch else None
            part_loss, part_stats = grpo_loss(
                logps, logps.detach() if old_logps is None else old_logps[rows], ref, batch["advantages"][rows],
                mask[rows], beta=cfg.beta, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
                loss_type=cfg.loss_type, importance_sampling_level=cfg.importance_sampling_level,
                kl_estimator=cfg.kl_estimator, max_completion_length=cfg.max_new_tokens, impl=cfg.loss_impl,
                sampler_logps=None if sampler_logps is None else sampler_logps[rows], tis_cap=tis_cap)
            share = weight * ((mask[rows].sum() / mask.sum().clamp(min=1)).item() if token_mean else (q1 - q0) / Q)
            engine.set_gradient_accumulation_boundary(i == len(parts) - 1)  # one optimizer step after the last
            engine.backward(part_loss * share)
            loss += part_loss.item() * share
            add_part_stats(stats, part_stats, (mask[rows].sum() / mask.sum().clamp(min=1)).item())
            entropy += (part_entropy * mask[rows]).sum().item()
        old_logps = torch.cat(new_logps) if old_logps is None else old_logps
        # one NaN or inf in an update would reach every weight through Adam's moments: skip it.
        # ZeRO 0 leaves the gradients whole on the parameters, where we check them; ZeRO 1-3
        # check them in step() themselves.
        norm = grad_norm(engine)
        if norm is not None and not (math.isfinite(norm) and math.isfinite(loss)):
            engine.optimizer.zero_grad(set_to_none=True)
            skipped += 1
            continue
        engine.step()
        skipped += not engine.was_step_applied()
    stats["loss"], stats["entropy"] = loss, entropy / mask.sum().clamp(min=1).item()
    stats["lr"], stats["tokens"] = engine.get_lr()[0], int(mask.sum())  # tokens: completion tokens trained on
    stats["grad_norm"] = norm if norm is not None else float(engine.get_global_grad_norm() or 0.0)
    if skipped == cfg.num_iterations:
        stats["grad_norm"] = None  # no update was taken
    stats["skipped_updates"] = int(skipped)
    return stats, torch.cat(new_logps)


def main(cfg: Config):
    reward_weights, problems = check_options(cfg), load_data(cfg)
    check_run_dir(cfg)  # a used runs/RUN_NAME/ needs --resume or --overwrite
    show_plan(cfg)
    if cfg.beta != 0:
        ref_request(cfg, "GET", "/health")  # fail fast, with a clear message, if the server is absent
    if cfg.preflight and int(os.environ.get("RANK", "0")) == 0:
        preflight(cfg)
    engine, tokenizer = make_engine(cfg)
    rank, world, B = engine.global_rank, engine.world_size, cfg.batch_prompts
    torch.manual_seed(cfg.seed + rank)  # each rank samples its own completions (a resume restores this state)
    rng = random.Random(cfg.seed)  # draws the problems: its state is the data position
    run_dir, metrics_path, first_step, state = open_run(cfg, engine)
    if state is not None:
        rng.setstate(state["data_rng"])
    run_id, G = uuid.uuid4().hex, cfg.num_generations  # run_id tells this rank's groups from others'
    stop_ids = stop_token_ids(tokenizer, cfg.prompt_format)  # EOS, and the chat template's turn end
    # several ranks (deepspeed --num_gpus N, torchrun): each takes its share of the step's problems
    # and samples with its own seed; DeepSpeed averages their gradients into one step
    synced = cfg.zero_stage == 3 and world > 1  # ZeRO-3 gathers weights in every forward: all ranks run as many
    doctor = RunDoctor(cfg, metrics_path) if rank == 0 else None  # plain-language warnings (doctor.py)
    tracker = Tracker(cfg, run_dir) if rank == 0 else None  # --report_to tensorboard/wandb

    bar = tqdm(range(first_step, cfg.steps + 1), desc="grpo", initial=first_step - 1, total=cfg.steps,
               disable=rank != 0)
    for step in bar:
        t0 = time.time()
        # 1. rollouts from the current policy
        batch_problems = rng.sample(problems, B * world)[rank * B:(rank + 1) * B]
        prompts = [make_prompt(tokenizer, p["question"], cfg.prompt_format) for p in batch_problems]
        prompt_ids, prompt_mask, completion_ids = generate(engine.module, tokenizer, prompts, cfg, stop_ids, synced)
        mask = completion_mask(completion_ids, stop_ids)
        texts = tokenizer.batch_decode(completion_ids * mask.long() + tokenizer.pad_token_id * (1 - mask.long()),
                                       skip_special_tokens=True)
        gen_s = time.time() - t0

        # 2. rewards and group-relative advantages; groups with no reward variance are dropped
        rewards, scores = score_groups(texts, batch_problems, G, reward_weights)
        prompt_rows = [ids[m.bool()] for ids, m in zip(prompt_ids, prompt_mask)]
        meta = {"run_id": run_id, "policy_version": step, "temperature": cfg.temperature}
        groups, has_signal = make_groups(prompt_rows, completion_ids, mask, rewards, G, meta,
                                         keep_equal=world > 1, scale_rewards=cfg.scale_rewards, scores=scores)
        weight = 1.0
        if world > 1:  # every rank must take part in the step: one with no signal trains a group at weight 0
            weight = float(has_signal.any())
            groups = [g for g, keep in zip(groups, has_signal.tolist()) if keep] or groups[:1]

        # 3.-4. reference log-probs from the server (none needed when beta is 0), then the GRPO update
        stats = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "ratio_mean": 1.0, "grad_norm": 0.0}
        t1 = time.time()
        if groups:
            finished = get_ref_logps(cfg, groups, run_id, bar) if cfg.beta != 0 else [t for t, _ in groups]
            batch = collate(finished, tokenizer.pad_token_id)
            t2 = time.time()
            stats, logps = grpo_update(engine, batch, cfg, stop_ids, weight)
        ref_s, compute_s = (t2 - t1, time.time() - t2) if groups else (0.0, 0.0)

        # log what we measured, a few completions, and what the run doctor makes of it
        record = {"step": step, **rollout_stats(rewards, scores, mask, has_signal, gen_s,
                                                is_truncated(completion_ids, stop_ids)),
                  **stats, "ref_s": ref_s, "compute_s": compute_s, "step_s": time.time() - t0}
        stop = None
        if rank == 0:  # rank 0's own rollouts and loss
            log_step(metrics_path, record, tracker)
            if groups and weight and cfg.log_completions_every and step % cfg.log_completions_every == 0:
                log_batch_completions(run_dir, step, tokenizer, batch, [s for _, m in groups for s in m["scores"]],
                                      stop_ids, logps)
            stop = doctor.batch(batch_summary(rewards, scores, texts, has_signal), step) or doctor.step(record)
        bar.set_postfix(reward=f"{record['reward_mean']:.2f}", acc=f"{record['accuracy']:.2f}",
                        fmt=f"{record['format_rate']:.2f}", kl=f"{record['kl']:.3f}")
        stopping = bool(max_over_ranks(stop is not None))  # every rank stops with rank 0's doctor
        if step % cfg.save_every == 0 or step == cfg.steps or stopping:
            save_checkpoint(engine, tokenizer, run_dir, step, {"data_rng": rng.getstate()})
        if stopping:
            finish_run(run_dir, step, rank, tracker)
            raise SystemExit(stop or "stopped: rank 0's run doctor stopped the run")

    finish_run(run_dir, cfg.steps, rank, tracker)


if __name__ == "__main__":
    main(parse_flags(Config, __doc__))
