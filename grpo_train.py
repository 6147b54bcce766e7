"""grpo_train.py: the simplest complete GRPO trainer. One process samples with the policy itself and trains
it; each pass of the loop below is one GRPO step, stage by stage, calling grpo_math.py for the math and
simple_grpo/ for the sampler, the rewards, the ref server's client and the optimizer step (named below).
Several ranks, --micro_batch_groups, --loss_impl triton and the shared-prompt path for the policy's own
log-probs (simple_grpo/logprobs.py) are grpo_vllm_one.py's: here those log-probs are one plain forward.

    python ref_server.py &          # the frozen reference model (the tiny default), 127.0.0.1:59875
    python grpo_train.py            # tiny default model and toy task, on CPU
    python ref_server.py --model Qwen/Qwen2.5-0.5B &    # the server must hold the trainer's --model (checked)
    deepspeed --num_gpus 1 grpo_train.py --model Qwen/Qwen2.5-0.5B --dataset openai/gsm8k --dataset_config main
    python grpo_train.py --beta 0           # no KL term: no reference server at all
    python grpo_train.py --use_peft         # LoRA adapters; the base, adapters off, is the reference: no server

Every step, in order (the lines marked `# GRPO n.` below; docs/guide.md's reading path lists, traced, the
functions, constants and flags a step runs through):
  1. draw `batch_prompts` (Q) problems and sample `num_generations` (G) completions for each with the
     policy itself (transformers generate: simple_grpo/generation/hf_sampler.py, which runs each prompt once
     and copies its KV cache G times, one copy per completion);
  2. score them (simple_grpo/rollouts.py, simple_grpo/task/rewards.py) and form group-relative advantages;
     keep the groups with a non-zero advantage (GRPO: their rewards differ; in the others every advantage is
     0: with beta > 0 their KL term would still pull towards the reference; dropping them is a choice, TRL
     keeps them, and saves their compute);
  3. the reference model's log-probs of the same tokens, for the KL term: each kept group is uploaded to
     ref_server.py and taken back with them (simple_grpo/protocol.py's reference_logps_from_server); with
     LoRA: our own model, adapters off; with beta 0: none;
  4. the policy's log-probs (grpo_math.completion_logps: each prompt once, its cache copied G times) and the GRPO
     loss (grpo_math.grpo_loss: grpo_objective with TRL's options); backward; one AdamW step (DeepSpeed's
     engine.step(), through simple_grpo/trainer/update.py's optimizer_step: --lr, --adam_beta1, --adam_beta2,
     --adam_epsilon, --weight_decay, --max_grad_norm). --num_iterations > 1 repeats 4 on the same rollouts
     (PPO's epochs).
Every number a default step uses is a flag, `python grpo_train.py --help` lists each with its default
(simple_grpo/trainer/config.py's TrainerConfig, and the task/problems.py TaskConfig it extends: G, T,
--max_new_tokens), the 1e-4 added to a group's reward std too (--advantage_eps; TRL's value).
At start it prints every number of a step as one block, with why for each derived default (trainer/config.py's
check_options). `make demo` runs grpo_vllm_one.py; its step, read: docs/guide.md, "Reading one step of `make demo`".
runs/NAME/config.json holds every flag as resolved. It writes one JSON line per step to runs/NAME/metrics.jsonl
(a step with no group kept logs its update's figures as null), checkpoints to runs/NAME/step_N/ (HF format, plus
the state --resume continues from), and the curves to runs/NAME/curves.png.
"""
import os
import random
import time
import uuid
from dataclasses import dataclass

import torch
from tqdm import tqdm

from grpo_math import (completion_logps, completion_mask, group_advantages, groups_with_signal, grpo_loss,
                       is_truncated)
from simple_grpo.flags import flag, parse_flags
from simple_grpo.generation.hf_sampler import generate
from simple_grpo.protocol import check_reference, reference_logps_from_server, uses_ref_server
from simple_grpo.rollouts import correct_rows, rollout_stats, score_groups
from simple_grpo.run.checkpoints import check_run_dir, open_run, save_checkpoint
from simple_grpo.run.completions_log import log_batch_completions
from simple_grpo.run.doctor import RunDoctor, batch_summary
from simple_grpo.run.metrics import Tracker, finish_run, log_step
from simple_grpo.task.problems import load_data, make_prompt, stop_token_ids
from simple_grpo.task.rewards import parse_reward_spec, pick_accuracy_reward
from simple_grpo.trainer.config import TrainerConfig, check_options
from simple_grpo.trainer.deepspeed_engine import leave_process_group, make_engine
from simple_grpo.trainer.memory_plan import show_plan
from simple_grpo.trainer.update import loss_options, optimizer_step, step_stats


@dataclass
class Config(TrainerConfig):
    """grpo_train.py's flags: the trainers' shared ones (simple_grpo/trainer/config.py), and these."""
    SECTIONS = {**TrainerConfig.SECTIONS, "run_name": "this script"}
    run_name: str = flag("demo", "outputs go to runs/RUN_NAME/ ($SIMPLE_GRPO_RUNS/RUN_NAME/ where that is set)")
    threads: int = flag(2, "CPU threads for torch")


def check_one_process(cfg):
    """Stop, naming the trainer that has it, on what this one leaves to grpo_vllm_one.py."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for asked, what in ((world > 1, f"{world} ranks"), (cfg.micro_batch_groups, "--micro_batch_groups"),
                        (cfg.loss_impl != "torch", f"--loss_impl {cfg.loss_impl}")):
        if asked:
            raise SystemExit(f"{what}: grpo_train.py keeps one step simple (one process, one forward per update); "
                             "python -m simple_grpo.train has it, with the same flags")


def main(cfg: Config):
    check_one_process(cfg)
    check_options(cfg)  # refuses bad values; fills in (and prints) the defaults that depend on other flags
    reward_weights = parse_reward_spec(cfg.reward_funcs, cfg.reward_weights)  # {"correctness": 1.0, "format": 0.5}
    problems = load_data(cfg)
    show_plan(cfg)  # --plan prints it and stops here, before the run directory is looked at
    check_run_dir(cfg)  # a used runs/RUN_NAME/ needs --resume or --overwrite
    if uses_ref_server(cfg):
        check_reference(cfg)  # fail fast if the server is absent, or serves another model than ours
    if cfg.preflight:
        from simple_grpo.run.preflight import preflight
        preflight(cfg)
    engine, tokenizer = make_engine(cfg)  # the policy, wrapped by DeepSpeed with its AdamW
    torch.manual_seed(cfg.seed)  # the sampling (a resume restores this state)
    rng = random.Random(cfg.seed)  # draws the problems: its state is the data position
    run_dir, metrics_path, first_step, state = open_run(cfg, engine)
    if state is not None:
        rng.setstate(state["data_rng"])
    run_id, Q, G = uuid.uuid4().hex, cfg.batch_prompts, cfg.num_generations  # run_id: our groups in the server
    stop_ids = stop_token_ids(tokenizer, cfg.prompt_format)  # EOS, and the chat template's turn end
    doctor = RunDoctor(cfg, metrics_path)  # plain-language warnings (run/doctor.py)
    tracker = Tracker(cfg, run_dir) if cfg.report_to != "none" else None  # --report_to tensorboard/wandb

    def waiting(group, waited_s):
        bar.set_description_str(f"waiting for the ref server's log-probs: group {group + 1} ({waited_s:.0f} s, "
                                f"gives up after {cfg.ref_timeout:.0f} s)")

    bar = tqdm(range(first_step, cfg.steps + 1), desc="grpo", initial=first_step - 1, total=cfg.steps)
    for step in bar:
        t0 = time.time()
        # GRPO 1. sample G completions per problem with the current policy (transformers generate)
        batch_problems = rng.sample(problems, Q)
        prompts = [make_prompt(tokenizer, p["question"], cfg.prompt_format, cfg.system_prompt) for p in batch_problems]
        # prompt_ids, prompt_mask (Q, P) left-padded; completion_ids (Q*G, C) right-padded, group after group
        prompt_ids, prompt_mask, completion_ids = generate(engine.module, tokenizer, prompts, cfg, stop_ids)
        until_stop = completion_mask(completion_ids, stop_ids)  # (Q*G, C): 1 up to and including the first stop token
        texts = tokenizer.batch_decode(completion_ids.masked_fill(until_stop == 0, tokenizer.pad_token_id),
                                       skip_special_tokens=True)  # each completion's text, up to its stop token
        gen_s = time.time() - t0

        # GRPO 2. score them; group-relative advantages; keep the groups with a non-zero advantage
        rewards, scores = score_groups(texts, batch_problems, G, reward_weights)  # (Q*G,), a breakdown each
        advantages = group_advantages(rewards, G, scale_rewards=cfg.scale_rewards, eps=cfg.advantage_eps,
                                      estimator=cfg.advantage_estimator,
                                      correct=correct_rows(scores, reward_weights)).float()  # raft: the correct ones
        has_signal = groups_with_signal(advantages, G)  # (Q,): GRPO: the rewards differ
        truncated = is_truncated(completion_ids, stop_ids)  # (Q*G,): cut off at --max_new_tokens
        # the batch's log figures; their accuracy is the correctness reward trained on
        rollout_figures = rollout_stats(rewards, scores, until_stop, has_signal, gen_s, truncated,
                                        pick_accuracy_reward(reward_weights))
        kept_groups = has_signal.to(until_stop.device)  # (Q,)
        kept_rows = has_signal.repeat_interleave(G).to(until_stop.device)  # (Q*G,): the G rows of each kept group
        prompt_ids, prompt_mask = prompt_ids[kept_groups], prompt_mask[kept_groups]  # (q, P) each: q groups kept
        completion_ids, until_stop = completion_ids[kept_rows], until_stop[kept_rows]  # (q*G, C) each
        advantages = advantages.to(until_stop.device)[kept_rows]  # (q*G,)
        update_stats = {"loss": None, "kl": None, "clip_fraction": None, "ratio_mean": None,
                        "grad_norm": None}  # no group kept: no update, nothing of it measured (null in the log)
        t1 = t2 = time.time()
        if has_signal.any():
            # GRPO 3. the reference model's log-probs of the same tokens, for the KL term: what
            # grpo_math.completion_logps computes under the frozen model in evaluation mode, by the server's own
            # function and in its --dtype (bf16 on a GPU by default: tests/test_ref_server.py compares them)
            ref_logps = None  # beta 0: no KL term
            if uses_ref_server(cfg):  # one upload per kept group, then each group's answer, polled until ready
                meta = {"run_id": run_id, "policy_version": step, "temperature": cfg.temperature}
                ref_logps = reference_logps_from_server(cfg, run_id, prompt_ids, prompt_mask, completion_ids,
                                                        until_stop, meta, waiting)  # (q*G, C)
                bar.set_description_str("grpo")
            elif cfg.beta != 0:  # --use_peft: the reference is our own base model, its adapters off
                engine.eval()  # the reference as the ref server computes it: evaluation mode, no dropout
                with engine.module.disable_adapter(), torch.no_grad():
                    ref_logps, _ = completion_logps(engine, prompt_ids, prompt_mask, completion_ids, cfg.temperature)
            ref_logps = None if ref_logps is None else ref_logps.to(until_stop.device)
            t2 = time.time()

            # GRPO 4. the policy's log-probs, the GRPO loss, backward, one optimizer step. engine.step() (in
            # optimizer_step) does what a plain loop writes out: clip the gradients' global 2-norm to
            # --max_grad_norm, one AdamW step (--lr, constant; --adam_beta1, --adam_beta2, --adam_epsilon,
            # --weight_decay), zero the gradients: simple_grpo/trainer/deepspeed_engine.py's flag_config passes
            # the flags to DeepSpeed (a --deepspeed file may change them; the run says so)
            engine.train()  # training mode: gradient checkpointing and dropout (if not disabled) act only in it
            loss_mask = completion_mask(completion_ids, stop_ids, cfg.mask_truncated_completions)  # (q*G, C)
            skipped = 0  # updates not taken: a NaN or inf in the gradient or the loss
            for iteration in range(cfg.num_iterations):  # more than 1: PPO's epochs on the same rollouts
                logps, entropy = completion_logps(engine, prompt_ids, prompt_mask, completion_ids,
                                                  cfg.temperature)  # (q*G, C) each
                if iteration == 0:  # this forward's own numbers: ratio 1 now, the clip bounds the next (they
                    # are the sampler's up to dropout, which generate runs without: --disable_dropout makes them equal)
                    old_logps = logps.detach()  # (q*G, C)
                loss, update_stats = grpo_loss(logps, old_logps, ref_logps, advantages, loss_mask, **loss_options(cfg))
                engine.backward(loss)
                norm, stepped = optimizer_step(engine, loss.item())  # skipped if anything is NaN or inf
                skipped += not stepped
            tokens = loss_mask.sum().clamp(min=1).item()
            update_stats.update(loss=loss.item(), entropy=(entropy * loss_mask).sum().item() / tokens,  # a token mean
                                tokens=int(loss_mask.sum()), **step_stats(engine, norm, skipped, cfg.num_iterations))

        # log what we measured, a few completions, and what the run doctor makes of it
        record = {"step": step, **rollout_figures, **update_stats, "ref_s": t2 - t1, "compute_s": time.time() - t2,
                  "step_s": time.time() - t0}
        log_step(metrics_path, record, tracker)
        if has_signal.any() and cfg.log_completions_every and step % cfg.log_completions_every == 0:
            batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                     "advantages": advantages}
            log_batch_completions(run_dir, step, tokenizer, batch, [s for s, k in zip(scores, kept_rows.tolist()) if k],
                                  stop_ids, logps.detach())
        stop_reason = doctor.batch(batch_summary(rewards, scores, texts, has_signal), step) or doctor.step(record)
        bar.set_postfix(reward=f"{record['reward_mean']:.2f}", acc=f"{record['accuracy']:.2f}",
                        fmt=f"{record['format_rate']:.2f}", kl="-" if record["kl"] is None else f"{record['kl']:.3f}")
        if step % cfg.save_every == 0 or step == cfg.steps or stop_reason:
            save_checkpoint(engine, tokenizer, run_dir, step, {"data_rng": rng.getstate()})
        if stop_reason:
            finish_run(run_dir, step, 0, tracker)
            raise SystemExit(stop_reason)

    finish_run(run_dir, cfg.steps, 0, tracker)


if __name__ == "__main__":
    main(parse_flags(Config, __doc__))
    leave_process_group()  # the process ends (here, not in main(): main() stays callable again in one process)
