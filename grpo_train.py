"""grpo_train.py: the simplest complete GRPO trainer.

    python ref_server.py &          # the frozen reference model, 127.0.0.1:59875
    python grpo_train.py            # tiny default model and toy task, on CPU
    deepspeed grpo_train.py --model Qwen/Qwen2.5-0.5B --dataset openai/gsm8k --dataset_config main
    python grpo_train.py --beta 0           # no KL term: no reference server at all
    python grpo_train.py --use_peft         # LoRA adapters; the base, adapters off, is the reference: no server

Every step, in order:
  1. sample `batch_prompts` problems and generate `num_generations` completions for each
     with the policy itself (transformers generate, KV cache, temperature sampling);
  2. score them (simple_grpo/task/rewards.py) and form group-relative advantages; groups whose rewards
     are all equal teach nothing (every advantage is 0) and are dropped;
  3. post the groups to the reference server and take them back with reference log-probs;
  4. compute the GRPO loss (grpo_math.py) and take an optimizer step with DeepSpeed.
Read the lines marked `# GRPO n.` for the algorithm; the rest is plumbing from simple_grpo/.
It writes one JSON line per step to runs/NAME/metrics.jsonl, checkpoints to runs/NAME/step_N/
(HF format, plus the state --resume continues from), and the curves to runs/NAME/curves.png.
"""
import os
import random
import time
import uuid
from dataclasses import dataclass

import torch
from tqdm import tqdm

from grpo_math import completion_mask, is_truncated
from simple_grpo.devices import max_over_ranks
from simple_grpo.flags import flag, parse_flags
from simple_grpo.generation.hf_sampler import generate
from simple_grpo.protocol import post_groups, take_group, uses_ref_server
from simple_grpo.reference.fingerprint import check_reference
from simple_grpo.rollouts import collate, make_groups, rollout_stats, score_groups
from simple_grpo.run.checkpoints import check_run_dir, open_run, save_checkpoint
from simple_grpo.run.completions_log import log_batch_completions
from simple_grpo.run.doctor import RunDoctor, batch_summary
from simple_grpo.run.metrics import Tracker, log_step
from simple_grpo.run.preflight import preflight
from simple_grpo.run.report import finish_run
from simple_grpo.task.config import load_data
from simple_grpo.task.problems import make_prompt, stop_token_ids
from simple_grpo.trainer.config import TrainerConfig, check_options
from simple_grpo.trainer.deepspeed_engine import make_engine
from simple_grpo.trainer.memory_plan import show_plan
from simple_grpo.trainer.update import grpo_update, reference_logps


@dataclass
class Config(TrainerConfig):
    """grpo_train.py's flags: the trainers' shared ones (simple_grpo/trainer/config.py), and these."""
    SECTIONS = {**TrainerConfig.SECTIONS, "run_name": "this script"}
    run_name: str = flag("demo", "outputs go to runs/RUN_NAME/")
    threads: int = flag(2, "CPU threads for torch")


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


def main(cfg: Config):
    reward_weights, problems = check_options(cfg), load_data(cfg)
    show_plan(cfg)  # --plan prints it and stops here, before the run directory is looked at
    check_run_dir(cfg)  # a used runs/RUN_NAME/ needs --resume or --overwrite
    if uses_ref_server(cfg):
        check_reference(cfg)  # fail fast if the server is absent, or serves another model than ours
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
    doctor = RunDoctor(cfg, metrics_path) if rank == 0 else None  # plain-language warnings (run/doctor.py)
    tracker = Tracker(cfg, run_dir) if rank == 0 else None  # --report_to tensorboard/wandb

    bar = tqdm(range(first_step, cfg.steps + 1), desc="grpo", initial=first_step - 1, total=cfg.steps,
               disable=rank != 0)
    for step in bar:
        t0 = time.time()
        # GRPO 1. sample G completions per problem with the current policy (simple_grpo/generation/hf_sampler.py)
        batch_problems = rng.sample(problems, B * world)[rank * B:(rank + 1) * B]
        prompts = [make_prompt(tokenizer, p["question"], cfg.prompt_format, cfg.system_prompt) for p in batch_problems]
        prompt_ids, prompt_mask, completion_ids = generate(engine.module, tokenizer, prompts, cfg, stop_ids, synced)
        mask = completion_mask(completion_ids, stop_ids)
        texts = tokenizer.batch_decode(completion_ids * mask.long() + tokenizer.pad_token_id * (1 - mask.long()),
                                       skip_special_tokens=True)
        gen_s = time.time() - t0

        # GRPO 2. score them; group-relative advantages; groups whose rewards are all alike are dropped
        rewards, scores = score_groups(texts, batch_problems, G, reward_weights)
        prompt_rows = [ids[m.bool()] for ids, m in zip(prompt_ids, prompt_mask)]
        meta = {"run_id": run_id, "policy_version": step, "temperature": cfg.temperature}
        groups, has_signal = make_groups(prompt_rows, completion_ids, mask, rewards, G, meta,
                                         keep_equal=world > 1, scale_rewards=cfg.scale_rewards, scores=scores)
        weight = 1.0
        if world > 1:  # every rank must take part in the step: one with no signal trains a group at weight 0
            weight = float(has_signal.any())
            groups = [g for g, keep in zip(groups, has_signal.tolist()) if keep] or groups[:1]

        # GRPO 3. reference log-probs for the KL term: from the server, or with LoRA from our own model with
        # its adapters off (simple_grpo/trainer/update.py); none needed when beta is 0
        stats = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "ratio_mean": 1.0, "grad_norm": 0.0}
        t1 = time.time()
        if groups:
            finished = get_ref_logps(cfg, groups, run_id, bar) if uses_ref_server(cfg) else [t for t, _ in groups]
            batch = collate(finished, tokenizer.pad_token_id)
            if cfg.beta != 0 and not uses_ref_server(cfg):
                batch["ref_logps"] = reference_logps(engine, batch, cfg)
            t2 = time.time()
            # GRPO 4. the update: log-probs, grpo_math.grpo_loss, backward, one optimizer step
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
