r"""grpo_vllm_one.py: the fast GRPO trainer. vLLM generates the next batches while DeepSpeed trains.

    python ref_server.py &                 # the frozen reference model (the tiny default), 127.0.0.1:59875
    python grpo_vllm_one.py                # tiny default model and toy task, on CPU
    python ref_server.py --model Qwen/Qwen2.5-0.5B &      # GPU 0; the server must hold the trainer's --model
    deepspeed --include localhost:2 grpo_vllm_one.py --gen_device 1 --model Qwen/Qwen2.5-0.5B \
        --dataset openai/gsm8k --dataset_config main      # the trainer on GPU 2, vLLM on GPU 1

Three processes, one pipeline (ref_server.py is the third; with --beta 0 there is none):

  generation worker (vLLM, its own device)        trainer (DeepSpeed, rank 0)
  ---------------------------------------------   ----------------------------------------
  sample G completions per prompt with their      take a batch from the ref server (FIFO)
  log-probs; score; post groups to ref server ->  (ref server adds ref_logps)
  load new weights when they come             <-  GRPO update; every sync_every steps,
                                                  send the full weights in memory

While the trainer computes step s, the worker already samples the batch for step s+1 with
slightly older weights (never more than `max_policy_lag` versions: the timeline is WorkerSchedule's
docstring, simple_grpo/generation/schedule.py). Each rollout carries the policy version and vLLM's
log-probs (sampler_logps); the update weights each token by min(pi_old / pi_vLLM, tis_cap) (capped
importance sampling, the literature's "truncated" IS): the mismatch from the lag and the two engines'
numerics is corrected where the ratio is below the cap and bounded above it (biased there); the KL term is not
reweighted.
Where sampling is the slow part, --gen_workers K runs K workers that make the batches in turn.

Every step, in order: the worker's `# GRPO 1.` sample, `2.` score and group, then post; the trainer's
`3.` take the batch with its reference log-probs, `4.` the update, `5.` send the new weights.
Read the lines marked `# GRPO n.` for the algorithm (the loss itself: grpo_math.py); the rest is
plumbing from simple_grpo/: the worker processes (generation/workers.py), the weight channel
(generation/weight_sync.py), the waits (generation/progress.py), the run doctor (run/doctor.py).
At start it prints every number of a step as one block, and why for each default it derived from other flags
(trainer/config.py's check_options);
runs/NAME/config.json holds every flag as resolved. vLLM logs only its errors unless VLLM_LOGGING_LEVEL is set.
"""
import dataclasses
import os
import random
import signal
import sys
import time
import uuid
from dataclasses import dataclass

import torch.distributed as dist
from tqdm import tqdm

from grpo_math import completion_mask, is_truncated
from simple_grpo.devices import max_over_ranks
from simple_grpo.flags import flag, parse_flags
from simple_grpo.generation.config import GenerationConfig
from simple_grpo.generation.progress import WorkerProgress
from simple_grpo.generation.schedule import WorkerSchedule, batch_worker, stream_id
from simple_grpo.generation.vllm_sampler import sample, start_vllm, stop_vllm
from simple_grpo.generation.weight_sync import WeightSender, sync_weights
from simple_grpo.generation.workers import (check_workers, draws_to_resume, local_world_size, start_workers,
                                            stop_workers, take_local_group, wait_for_vllm, watch_parent)
from simple_grpo.protocol import check_reference, post_groups, take_group, uses_ref_server
from simple_grpo.rollouts import collate, correct_rows, make_groups, rollout_stats, score_groups
from simple_grpo.run.checkpoints import check_run_dir, open_run, save_checkpoint
from simple_grpo.run.completions_log import log_batch_completions
from simple_grpo.run.doctor import RunDoctor, batch_summary
from simple_grpo.run.metrics import Tracker, finish_run, log_step
from simple_grpo.run.preflight import preflight
from simple_grpo.task.config import load_data
from simple_grpo.task.problems import make_prompt, stop_token_ids
from simple_grpo.task.rewards import extract_answer, parse_reward_spec, pick_accuracy_reward
from simple_grpo.trainer.config import TrainerConfig, check_options
from simple_grpo.trainer.deepspeed_engine import leave_process_group, make_engine
from simple_grpo.trainer.memory_plan import show_plan
from simple_grpo.trainer.update import grpo_update, reference_logps


@dataclass
class Config(GenerationConfig, TrainerConfig):
    """grpo_vllm_one.py's flags: the trainers' (simple_grpo/trainer/config.py), the generation worker's
    (simple_grpo/generation/config.py), and these."""
    SECTIONS = {**TrainerConfig.SECTIONS, **GenerationConfig.SECTIONS, "run_name": "this script"}
    run_name: str = flag("vllm_one", "outputs go to runs/RUN_NAME/")
    threads: int = flag(1, "the trainer's CPU threads (on a CPU machine the worker has cores of its own)")
    time_phases: bool = flag(False, "time each update by phase (forward, log_softmax, recompute, backward, loss, "
                                    "optimizer) into metrics.jsonl; on a GPU it waits for the GPU at each phase's end")
    profile_step: int = flag(0, "CUDA: profile this step's update (torch.profiler, slower), its GPU's idle seconds "
                                "to metrics.jsonl as gpu_wait_s, and its phases (bench/gpu_scale.py); 0: none")


# ---------------------------------------------------------------------------- generation worker
def gen_worker(cfg, run_id, ranks, worker, channels, parent_pid):
    """Worker process number `worker`: take new weights (schedule), then GRPO 1 sample, 2 score and group, and
    post the groups to the ref server (or, with beta 0, hand them to the trainer through channels.groups)
    for the trainer ranks `ranks`.
    With K workers it makes batches worker, worker + K, ...; every batch, kept or dropped, is reported
    on channels.status (generation/progress.py)."""
    watch_parent(parent_pid)  # a trainer killed without clean-up must not leave this process behind

    # the trainer notices a dead ref server first, and names it, if this process waits longer
    cfg = dataclasses.replace(cfg, peer_timeout=cfg.peer_timeout + 15)
    t0 = time.time()
    llm = start_vllm(cfg, compile=cfg.gen_compile, max_seqs=cfg.batch_prompts * cfg.num_generations)
    channels.status.put(("ready", time.time() - t0))
    tokenizer = llm.get_tokenizer()
    stop_ids = stop_token_ids(tokenizer, cfg.prompt_format, cfg.model)  # vLLM's stop set and the masks', one list
    check_options(cfg)  # this process loads the reward file too
    reward_weights, problems = parse_reward_spec(cfg.reward_funcs, cfg.reward_weights), load_data(cfg)
    rng, G = random.Random(cfg.seed + ranks[0] + 1000 * worker), cfg.num_generations  # each worker its own draws
    generated, ask_again = 0, []  # completions made so far; regroup: questions to ask once more
    world = int(os.environ.get("WORLD_SIZE", "1"))
    n = len(ranks)  # batch b goes to rank ranks[b % n]
    # which weights sample which batch, and when to wait for them (its docstring has the timeline)
    schedule = WorkerSchedule(cfg, llm, channels, n, first_batch_index=worker,
                              draw=lambda: rng.sample(problems, cfg.batch_prompts))
    while not channels.stop.is_set():
        if not schedule.take_weights_or_wait():  # it loaded weights or resumed, or waits for the next batch's
            continue

        # GRPO 1. sample G completions per problem with weights version schedule.version (vLLM), with their log-probs
        t0 = time.time()
        batch_problems = schedule.draw_problems() + ask_again
        prompts = [make_prompt(tokenizer, p["question"], cfg.prompt_format, cfg.system_prompt) for p in batch_problems]
        prompt_rows, completion_ids, sampler_logps = sample(llm, prompts, cfg, stop_ids)
        until_stop = completion_mask(completion_ids, stop_ids)  # (Q*G, C): 1 up to and including the first stop token
        texts = tokenizer.batch_decode(completion_ids.masked_fill(until_stop == 0, tokenizer.pad_token_id),
                                       skip_special_tokens=True)  # each completion's text, up to its stop token
        gen_s = time.time() - t0
        # GRPO 2. score them; group-relative advantages; groups whose rewards are all alike are dropped
        rewards, scores = score_groups(texts, batch_problems, G, reward_weights)
        meta = {"run_id": stream_id(run_id, ranks[schedule.batch_index % n], world, cfg, worker),
                "policy_version": schedule.version,
                "temperature": cfg.temperature, "worker": worker}
        groups, has_signal = make_groups(prompt_rows, completion_ids, until_stop, rewards, G, meta, sampler_logps,
                                         keep_equal=cfg.regroup, scale_rewards=cfg.scale_rewards, scores=scores,
                                         estimator=cfg.advantage_estimator, eps=cfg.advantage_eps,
                                         correct=correct_rows(scores, reward_weights))  # raft: the correct ones
        generated += completion_ids.size(0)
        truncated = is_truncated(completion_ids, stop_ids)  # (Q*G,): cut off at --max_new_tokens
        rollout_figures = {**rollout_stats(rewards, scores, until_stop, has_signal, gen_s, truncated,
                                           pick_accuracy_reward(reward_weights)),
                           "weights_load_s": schedule.load_s, "generated": generated}  # for the trainer's log
        channels.status.put(("batch", {**batch_summary(rewards, scores, texts, has_signal), "posted": len(groups)}))
        if cfg.regroup:  # a second round for the fresh questions whose answers all scored alike but
            # differ: the model is unsure of those, and another round may bring another reward
            answers = [extract_answer(text) for text in texts]
            ask_again = [p for q, p in enumerate(batch_problems[:cfg.batch_prompts])
                         if not has_signal[q] and len(set(answers[q * G:(q + 1) * G])) > 1]
        # post: to the trainer through the ref server (it adds ref_logps), or straight (beta 0)
        for _, m in groups:  # the trainer takes groups_in_batch groups as one batch
            m.update(batch_index=schedule.batch_index, draws=schedule.draws, groups_in_batch=len(groups),
                     rollout_figures=rollout_figures)
        if groups and uses_ref_server(cfg):
            post_groups(cfg, groups)
        for group in groups if not uses_ref_server(cfg) else []:
            channels.groups.put(group)  # local: tensors travel in shared memory, nothing is pickled over a network
        schedule.sampled(kept=bool(groups))  # a batch with no group kept is sampled again
    stop_vllm(llm)  # the engine and its process groups, before this process exits


# ---------------------------------------------------------------------------- training
def main(cfg: Config):
    if cfg.max_policy_lag < cfg.sync_every - 1:
        raise SystemExit(f"max_policy_lag={cfg.max_policy_lag} < sync_every-1={cfg.sync_every - 1}: the worker would "
                         f"wait for weights the trainer cannot make without its batches")
    # several ranks (deepspeed --num_gpus N): each node's local rank 0 (or every gen_every-th rank)
    # runs a generation worker that makes a batch per rank it serves, tagged with that rank's run_id;
    # the ref server hands each rank its own; DeepSpeed averages the gradients
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    check_options(cfg)  # bad options and data fail here, before any process starts
    if world > 1 and not uses_ref_server(cfg):
        raise SystemExit("several ranks take their batches from the ref server: use --beta > 0 (and with "
                         "--use_peft, --ref_url), or one rank")
    load_data(cfg)
    show_plan(cfg)  # --plan prints it and stops here, before the run directory is looked at
    check_run_dir(cfg)  # a used runs/RUN_NAME/ needs --resume or --overwrite
    if uses_ref_server(cfg):
        check_reference(cfg)  # fail fast if the server is absent, or serves another model than ours
    if cfg.preflight and rank == 0:
        preflight(cfg)
    run_id = uuid.uuid4().hex  # tells this run's groups from any another run left in the server
    # one worker per gen_every ranks (default: per node, on its local rank 0) serves those ranks
    every = cfg.gen_every or local_world_size(world)
    served = list(range(rank - rank % every, min(rank - rank % every + every, world)))
    if cfg.regroup and (every < world or cfg.gen_workers > 1):
        raise SystemExit("--regroup takes one generation worker: --gen_workers 1, --gen_every the number of ranks")
    workers = start_workers(gen_worker, cfg, run_id, served) if rank % every == 0 else []  # [(process, channels)]
    sender = WeightSender([c.weights for _, c in workers], [c.loaded for _, c in workers]) if workers else None
    check_alive = lambda: check_workers(workers)  # noqa: E731 - stops the run, naming a worker that died
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up below on `kill` too

    try:
        wait_for_vllm(workers, cfg)  # on a GPU it shares with vLLM, the trainer loads once vLLM is up
        engine, tokenizer = make_engine(cfg)
        if world > 1:  # every rank takes its batches under the run_id of the worker that serves it
            run_ids = [None] * world
            dist.all_gather_object(run_ids, run_id)
            run_id = run_ids[rank - rank % every]
        run_dir, metrics_path, first_step, state = open_run(cfg, engine)
        stop_ids = stop_token_ids(tokenizer, cfg.prompt_format, cfg.model)  # the worker's, for the masks
        doctor = RunDoctor(cfg, metrics_path) if rank == 0 else None  # plain-language warnings (run/doctor.py)
        progress = WorkerProgress(workers[0][1].status, cfg, doctor) if workers else None  # generation/progress.py
        tracker = Tracker(cfg, run_dir) if rank == 0 and cfg.report_to != "none" else None  # tensorboard/wandb
        generated, draws = [0] * cfg.gen_workers, [0] * cfg.gen_workers  # per worker: completions made, problems drawn
        if state is not None:  # resuming: the workers take up the checkpoint's data position and weights
            draws = draws_to_resume(state, cfg.gen_workers)
            for k, (_, channels) in enumerate(workers):
                next_batch = (first_step - 1) * len(served)
                channels.weights.put(("resume", next_batch + (k - next_batch) % cfg.gen_workers, draws[k]))
            sync_weights(sender, engine, first_step - 1, cfg.zero_stage, check_alive, cfg.data_timeout)
        bar = tqdm(range(first_step, cfg.steps + 1), desc="grpo (vllm)", initial=first_step - 1, total=cfg.steps,
                   disable=rank != 0)
        trained, stop_reason = 0, None  # completions in a trained group; why the run stops early (None: it goes on)

        def take(step):
            """The next group for this rank; while it waits, the bar says what for and the worker's progress."""
            def waiting(waited_s):
                check_alive()
                if progress is None:  # a rank without a worker: another rank's worker fills the ref server
                    deadline = cfg.data_timeout + (cfg.startup_timeout if step == first_step else 0)
                    if waited_s > deadline:
                        raise SystemExit(f"no batch for rank {rank} came from the ref server in {deadline:.0f} s")
                    return
                stop_reason = progress.update(step)
                if stop_reason:
                    raise SystemExit(stop_reason)
                bar.set_description_str(progress.describe(step, waited_s))
                progress.check_deadline(waited_s)
            k = batch_worker(step, rank, served, cfg)
            if uses_ref_server(cfg):
                return take_group(cfg, stream_id(run_id, rank, world, cfg, k), None, waiting, step - 1)
            return take_local_group(workers[k][1].groups, waiting)

        for step in bar:
            # GRPO 3. the next batch of groups the worker made, with the reference's log-probs (from the ref
            # server; with LoRA and no --ref_url, from our own model with its adapters off, just below)
            t0 = time.time()
            taken = [take(step)]
            n_groups = cfg.batch_prompts if cfg.regroup else taken[0][1]["groups_in_batch"]
            taken += [take(step) for _ in range(n_groups - 1)]
            groups, metas = [g for g, _ in taken], [m for _, m in taken]
            wait_s = time.time() - t0
            bar.set_description_str("grpo (vllm)")
            meta, oldest = metas[-1], min(m["policy_version"] for m in metas)
            trained += sum(g["completion_ids"].size(0) for g in groups)
            for m in metas:
                generated[m["worker"]] = max(generated[m["worker"]], m["rollout_figures"]["generated"])
                draws[m["worker"]] = max(draws[m["worker"]], m["draws"])

            batch = collate(groups, tokenizer.pad_token_id)
            # the tokens the loss counts: each completion up to its stop token (grpo_math.completion_mask; with
            # --mask_truncated_completions none of one cut off at --max_new_tokens), built once for the step
            batch["loss_mask"] = completion_mask(batch["completion_ids"], stop_ids, cfg.mask_truncated_completions)
            t_ref = time.time()
            if cfg.beta != 0 and not uses_ref_server(cfg):  # LoRA: the base model, adapters off
                batch["ref_logps"] = reference_logps(engine, batch, cfg)
            ref_s = time.time() - t_ref  # this trainer's reference pass (LoRA); a ref server's is in its /stats

            # GRPO 4. the update: grpo_math.grpo_loss on the batch, one optimizer step. The ratio's old_logps are
            # the trainer's own; vLLM's sampler_logps weight each token (--tis_cap; with 0 they are old_logps)
            if cfg.time_phases or step == cfg.profile_step:  # the same update, timed by phase (run/phase_timer.py)
                from simple_grpo.run.phase_timer import timed_update
                update_stats, logps = timed_update(grpo_update, engine, batch, cfg, profile=step == cfg.profile_step)
            else:
                update_stats, logps = grpo_update(engine, batch, cfg)
            compute_s = time.time() - t0 - wait_s

            # GRPO 5. send the new weights (in memory): version `step` samples the batches trained at steps
            # step + L + 2 - k to step + L + 1 (L: --max_policy_lag, k: --sync_every; the defaults: step + 2)
            if step % cfg.sync_every == 0 and step < cfg.steps:
                sync_weights(sender, engine, step, cfg.zero_stage, check_alive, cfg.data_timeout)
            record = {"step": step, **meta["rollout_figures"], **update_stats, "policy_lag": step - 1 - oldest,
                      "batch": meta["batch_index"], "worker": meta["worker"], "generated": sum(generated),
                      "trained": trained, "wait_s": wait_s, "compute_s": compute_s, "ref_s": ref_s,
                      "sync_s": time.time() - t0 - wait_s - compute_s, "step_s": time.time() - t0}

            # what this step measured: metrics.jsonl, a few completions, the run doctor's verdict
            stop_reason = progress.update(step) if progress is not None else None  # the batches made meanwhile
            if rank == 0:  # the whole batch's loss and diagnostics, rank 0's own batch's rewards and completions
                log_step(metrics_path, record, tracker)
                if cfg.log_completions_every and step % cfg.log_completions_every == 0:
                    log_batch_completions(run_dir, step, tokenizer, batch, [s for m in metas for s in m["scores"]],
                                          stop_ids, logps)
                stop_reason = doctor.step(record) or stop_reason
            bar.set_postfix(reward=f"{record['reward_mean']:.2f}", acc=f"{record['accuracy']:.2f}",
                            kl=f"{record['kl']:.3f}", lag=record["policy_lag"], wait=f"{wait_s:.2f}")
            last = bool(max_over_ranks(step == cfg.steps or 0 < cfg.max_completions <= sum(generated)
                                       or bool(stop_reason)))
            if step % cfg.save_every == 0 or last:  # the data position after every rank's batch
                save_checkpoint(engine, tokenizer, run_dir, step, {"draws": [int(max_over_ranks(d)) for d in draws]})
            if last:
                break
    finally:
        stop_workers(workers)
    finish_run(run_dir, step, rank, tracker)
    if stop_reason:
        raise SystemExit(stop_reason)


if __name__ == "__main__":
    main(parse_flags(Config, __doc__))
    leave_process_group()  # the process ends (here, not in main(): main() stays callable again in one process)
