r"""simple_grpo/train.py: the full GRPO trainer, every feature. vLLM generates the next batches while DeepSpeed trains.
(grpo_vllm_one.py, the lesson, is its default step alone.)

    python ref_server.py &                 # the frozen reference model (the tiny default)
    python -m simple_grpo.train            # tiny default model and toy task, on CPU
    python ref_server.py --model Qwen/Qwen2.5-0.5B &      # GPU 0; the server must hold the trainer's --model
    deepspeed --include localhost:2 --module simple_grpo.train --gen_device 1 --model Qwen/Qwen2.5-0.5B \
        --dataset openai/gsm8k --dataset_config main      # the trainer on GPU 2, vLLM on GPU 1

The generation worker (gen_worker, a process of its own) does `# GRPO 1.` sample and `2.` score and group, and
posts the groups to the ref server, which adds the reference log-probs (where no server is used, the groups go to
the trainer straight). The trainer (main) does `3.` take the batch, `4.` the update (the loss: grpo_math.py) and
`5.` send the new weights to the worker, in memory. The lines so marked are the algorithm; the rest is plumbing.

While the trainer computes step s, the worker samples step s+1's batch with weights at most --max_policy_lag versions
behind (WorkerSchedule; with a bound k >= 2, up to k batches in one vLLM call); each token's policy-gradient term is
weighted by min(pi_old / pi_vLLM, --tis_cap) (biased where the cap binds; the KL term is not). The same default step,
read in one file: grpo_vllm_one.py (the lesson; tests/test_lesson.py and tests/test_lesson_run.py hold the two equal).
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
from transformers import AutoTokenizer

from grpo_math import completion_mask, is_truncated
from simple_grpo.devices import max_over_ranks
from simple_grpo.flags import flag, parse_flags
from simple_grpo.generation.vllm_sampler import (check_context_length, generated_lengths, sample, start_vllm,
                                                 stop_vllm)
from simple_grpo.generation.weight_sync import WeightSender, WorkerSchedule, most_batches_per_call
from simple_grpo.generation.workers import (WorkerProgress, batch_worker, check_workers, local_world_size,
                                            resume_workers, start_workers, stop_workers, stream_id, take_local_group,
                                            wait_for_vllm)
from simple_grpo.protocol import check_reference, post_groups, take_group, uses_ref_server
from simple_grpo.rollouts import collate, correct_rows, make_groups, rollout_stats, score_groups
from simple_grpo.run.checkpoints import check_run_dir, open_run, save_checkpoint
from simple_grpo.run.completions_log import log_batch_completions
from simple_grpo.run.doctor import RunDoctor, batch_summary
from simple_grpo.run.metrics import Tracker, finish_run, log_step
from simple_grpo.task.problems import load_data, make_prompt, stop_token_ids
from simple_grpo.task.rewards import extract_answer, parse_reward_spec, pick_accuracy_reward
from simple_grpo.trainer.config import TrainerConfig, check_options
from simple_grpo.trainer.deepspeed_engine import leave_process_group, make_engine
from simple_grpo.trainer.memory_plan import show_plan
from simple_grpo.trainer.update import grpo_update, reference_logps


@dataclass
class Config(TrainerConfig):
    """The full trainer's flags: the trainers', the generation worker's, and this script's."""
    SECTIONS = {**TrainerConfig.SECTIONS, "gen_device": "the generation worker (vLLM)", "run_name": "this script"}
    gen_device: int = flag(-1, "vLLM's first GPU as nvidia-smi numbers it; -1: the first no trainer rank uses")
    gen_tp: int = flag(1, "vLLM tensor-parallel size: only 1 (more GPUs for sampling: --gen_workers K)")
    gen_every: int = flag(0, "one generation worker per this many trainer ranks (0: one per node)")
    gen_workers: int = flag(1, "generation workers (vLLM engines) per trainer, each on its own GPU or CPU cores")
    gen_threads: int = flag(1, "CPU machines: cores for each worker's vLLM (worker 0: the last ones, 1: those before)")
    gen_compile: bool = flag(False, "CPU machines: torch.compile vLLM's model (a slower start, faster sampling; "
                                    "on a GPU vLLM always compiles)")
    gen_memory: float = flag(0.0, "vLLM's gpu_memory_utilization; 0: 0.9 on a GPU of its own, 0.3 beside the trainer")
    max_model_len: int = flag(512, "vLLM's context length: prompt + completion (a completion that reaches it is cut "
                                   "off, like one at --max_new_tokens; the start counts the prompts it cannot hold)")
    tis_cap: float = flag(2.0, "capped importance sampling (TIS): each token weighted by min(pi_old / pi_vLLM, cap); "
                                "0: no weights, vLLM's log-probs are pi_old (the ratio's denominator) instead")
    sync_every: int = flag(1, "trainer steps between weight syncs to the worker")
    max_policy_lag: int = flag(1, "the worker waits rather than sample with weights older than this")
    regroup: bool = flag(False, "regroup_ver/: upload all groups; the regrouping server serves mixed-reward ones")
    max_completions: int = flag(0, "stop once the worker has generated this many completions (0: run all steps)")
    startup_timeout: float = flag(1200.0, "seconds the generation worker may take to start vLLM (load, compile)")
    startup_order: str = flag("auto", "auto: the trainer loads its model once vLLM is up where they share a GPU; "
                                      "vllm_first: always so; together: never wait")
    data_timeout: float = flag(600.0, "seconds to wait for a batch once vLLM is up (the worker: for new weights)")
    run_name: str = flag("vllm_one", "outputs go to runs/RUN_NAME/ ($SIMPLE_GRPO_RUNS/RUN_NAME/ where that is set)")
    threads: int = flag(1, "the trainer's CPU threads (not pinned; each worker: --gen_threads cores)")
    time_phases: bool = flag(False, "time each update by phase (forward, log_softmax, recompute, backward, loss, "
                                    "optimizer) into metrics.jsonl; on a GPU it waits for the GPU at each phase's end")
    profile_step: int = flag(0, "CUDA: profile this step's update (torch.profiler, slower), its GPU's idle seconds "
                                "to metrics.jsonl as gpu_wait_s, and its phases (bench/gpu_scale.py); 0: none")

    def __post_init__(self):  # refuses generation flags that cannot run
        if self.gen_tp != 1:  # tensor-parallel vLLM would pickle load_weights' iterator to its processes: it cannot
            raise SystemExit(f"--gen_tp {self.gen_tp}: simple_grpo/train.py syncs weights only into a vLLM of one GPU "
                             "(--gen_tp 1). For more sampling, run --gen_workers K one-GPU vLLM workers")
        if self.startup_order not in ("auto", "vllm_first", "together"):
            raise SystemExit(f"unknown --startup_order {self.startup_order!r}: use auto, vllm_first or together")
        if self.max_policy_lag < self.sync_every - 1:
            raise SystemExit(f"--max_policy_lag {self.max_policy_lag} < --sync_every - 1 = {self.sync_every - 1}: the "
                             "worker would wait for weights the trainer cannot make without its batches")


# ---------------------------------------------------------------------------- generation worker
def gen_worker(cfg, run_id, ranks, worker, channels):
    """Generation worker number `worker` (a process of its own) for the trainer ranks `ranks`: take new weights,
    then GRPO 1 sample, 2 score and group, and post the groups; report each batch on channels.status."""
    # the trainer notices a dead ref server first, and names it, if this process waits longer
    cfg = dataclasses.replace(cfg, peer_timeout=cfg.peer_timeout + 15)
    t0 = time.time()
    llm = start_vllm(cfg, compile=cfg.gen_compile,  # room for every sequence of a call's batches at once
                     max_seqs=most_batches_per_call(cfg) * cfg.batch_prompts * cfg.num_generations)
    channels.status.put(("ready", time.time() - t0))
    tokenizer = llm.get_tokenizer()
    stop_ids = stop_token_ids(tokenizer, cfg.prompt_format, cfg.model)  # vLLM's stop set and the masks', one list
    check_options(cfg)  # this process loads the reward file too
    reward_weights, problems = parse_reward_spec(cfg.reward_funcs, cfg.reward_weights), load_data(cfg)
    rng, G = random.Random(cfg.seed + ranks[0] + 1000 * worker), cfg.num_generations  # each worker its own draws
    generated, ask_again = 0, []  # completions made so far; --regroup: questions to ask once more
    world, n = int(os.environ.get("WORLD_SIZE", "1")), len(ranks)  # batch b goes to rank ranks[b % n]
    schedule = WorkerSchedule(cfg, llm, channels, n, first_batch_index=worker,
                              draw=lambda: rng.sample(problems, cfg.batch_prompts))
    while not channels.stop.is_set():
        if not schedule.take_weights_or_wait():  # GRPO 5. the worker's half: load the weights this call samples with
            continue

        # GRPO 1. sample G completions per problem with weights version schedule.version (vLLM), with their log-probs:
        # the batches of one call (one at --max_policy_lag 1; up to that many above it) as one generate
        t0 = time.time()
        batches = [(b, schedule.draw_problems() + ask_again, schedule.draws) for b in schedule.batches()]
        all_problems = [p for _, batch_problems, _ in batches for p in batch_problems]
        prompts = [make_prompt(tokenizer, p["question"], cfg.prompt_format, cfg.system_prompt) for p in all_problems]
        call_rows, call_ids, call_logps = sample(llm, prompts, cfg, stop_ids)  # Q x (P_q,); (Q*G, C) each
        call_lengths = generated_lengths(call_logps)  # (Q*G,) tokens vLLM generated: padding after them
        call_until_stop = completion_mask(call_ids, stop_ids, lengths=call_lengths)  # (Q*G, C): 1 up to the stop
        call_texts = tokenizer.batch_decode(call_ids.masked_fill(call_until_stop == 0, tokenizer.pad_token_id),
                                            skip_special_tokens=True)  # each completion's text, up to its stop token
        gen_s = time.time() - t0
        tokens_per_s = call_until_stop.sum().item() / gen_s  # the call's: its batches share its seconds
        generated += call_ids.size(0)
        schedule.calls, q0 = schedule.calls + 1, 0  # q0: the batch's first prompt in the call
        for batch_index, batch_problems, draws in batches:  # each batch on its own, in order
            q1 = q0 + len(batch_problems)
            rows = slice(q0 * G, q1 * G)  # its completions in the call
            C = int(call_lengths[rows].max())  # its own padding: none that only the call's other batches needed
            prompt_rows, texts, lengths = call_rows[q0:q1], call_texts[rows], call_lengths[rows]
            completion_ids, sampler_logps = call_ids[rows, :C], call_logps[rows, :C]  # (Q*G, C) each
            until_stop, q0 = call_until_stop[rows, :C], q1
            # GRPO 2. score them; group-relative advantages; groups whose rewards are all alike are dropped
            rewards, scores = score_groups(texts, batch_problems, G, reward_weights)  # (Q*G,), Q*G dicts
            meta = {"run_id": stream_id(run_id, ranks[batch_index % n], world, cfg, worker),
                    "policy_version": schedule.version, "temperature": cfg.temperature, "worker": worker}
            groups, has_signal = make_groups(prompt_rows, completion_ids, until_stop, rewards, G, meta, sampler_logps,
                                             keep_equal=cfg.regroup, scale_rewards=cfg.scale_rewards, scores=scores,
                                             estimator=cfg.advantage_estimator, eps=cfg.advantage_eps,
                                             correct=correct_rows(scores, reward_weights))  # raft: the correct ones
            truncated = is_truncated(completion_ids, stop_ids, lengths)  # (Q*G,): cut off with no stop token, at
            context_cut = truncated & (lengths < cfg.max_new_tokens)   # --max_new_tokens or at the context's end
            rollout_figures = {**rollout_stats(rewards, scores, until_stop, has_signal, gen_s, truncated,
                                               pick_accuracy_reward(reward_weights)),
                               "tokens_per_s": tokens_per_s,
                               "context_cut_frac": context_cut.float().mean().item(),
                               "weights_load_s": schedule.load_s, "generated": generated}  # for the trainer's log
            if cfg.max_policy_lag > 1:  # which vLLM call of this worker's sampled the batch, and with how many
                rollout_figures.update(gen_call=schedule.calls, gen_call_batches=len(batches))
            channels.status.put(("batch", {**batch_summary(rewards, scores, texts, has_signal), "posted": len(groups)}))
            if cfg.regroup:  # ask again the fresh questions whose answers differ though they all scored alike
                answers = [extract_answer(text) for text in texts]
                ask_again = [p for q, p in enumerate(batch_problems[:cfg.batch_prompts])
                             if not has_signal[q] and len(set(answers[q * G:(q + 1) * G])) > 1]
            for _, m in groups:  # the trainer takes groups_in_batch groups as one batch
                m.update(batch_index=batch_index, draws=draws, groups_in_batch=len(groups),
                         rollout_figures=rollout_figures)
            if uses_ref_server(cfg):
                post_groups(cfg, groups)  # prompt (P_q,), completions (G, C_q): the ref server adds ref_logps (G, C_q)
            else:
                for group in groups:
                    channels.groups.put(group)  # the tensors travel in shared memory
            schedule.sampled(kept=bool(groups))  # no group kept: new problems for the same batch
            if not groups:  # the groups go out in batch order: the call's later batches are sampled again too
                break
    stop_vllm(llm)  # the engine and its process groups, before this process exits


# ---------------------------------------------------------------------------- training
def batch_lags(metas, step, world):
    """The policy lag of each batch the step trains on (step - 1 - the version that sampled it), in batch order: this
    rank's (one batch; with --regroup the batches its groups came from), then each other rank's (a collective)."""
    versions = {(m["worker"], m["batch_index"]): m["policy_version"] for m in metas}
    lags = [step - 1 - version for _, version in sorted(versions.items())]
    if world > 1:
        every_rank = [None] * world
        dist.all_gather_object(every_rank, lags)
        lags = [lag for rank_lags in every_rank for lag in rank_lags]
    return lags


def main(cfg: Config):
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    check_options(cfg)  # bad options and data fail here, before any process starts
    if world > 1 and not uses_ref_server(cfg):
        raise SystemExit("several ranks take their batches from the ref server: use --beta > 0 (and with "
                         "--use_peft, --ref_url), or one rank")
    problems = load_data(cfg)
    show_plan(cfg)  # --plan prints it and stops here, before the run directory is looked at
    check_run_dir(cfg)  # a used runs/RUN_NAME/ needs --resume or --overwrite
    if uses_ref_server(cfg):
        check_reference(cfg)  # fail fast if the server is absent, or serves another model than ours
    if cfg.preflight and rank == 0:
        from simple_grpo.run.preflight import preflight
        preflight(cfg)
    # one worker set per gen_every ranks (default: per node), started by the first of them, makes the batches of
    # the ranks it serves (several ranks: DeepSpeed averages their gradients)
    every = cfg.gen_every or local_world_size(world)
    served = list(range(rank - rank % every, min(rank - rank % every + every, world)))
    if cfg.regroup and (every < world or cfg.gen_workers > 1):
        raise SystemExit("--regroup takes one generation worker: --gen_workers 1, --gen_every the number of ranks")
    run_id = uuid.uuid4().hex  # tells this run's groups from any other run's left in the server
    workers = start_workers(gen_worker, cfg, run_id, served) if rank % every == 0 else []  # [(process, channels)]
    sender = WeightSender([c.weights for _, c in workers], [c.loaded for _, c in workers])
    check_alive = lambda: check_workers(workers)  # noqa: E731 - stops the run, naming a worker that died
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up below on `kill` too

    try:  # while vLLM starts: does its context hold each prompt (and --max_new_tokens)?
        check_context_length(cfg, problems, AutoTokenizer.from_pretrained(cfg.model))
        wait_for_vllm(workers, cfg)  # on a GPU it shares with vLLM, the trainer loads once vLLM is up
        engine, tokenizer = make_engine(cfg)
        if world > 1:  # every rank takes its batches under the run_id of the rank that started its worker
            run_ids = [None] * world
            dist.all_gather_object(run_ids, run_id)
            run_id = run_ids[rank - rank % every]
        run_dir, metrics_path, first_step, state = open_run(cfg, engine)
        stop_ids = stop_token_ids(tokenizer, cfg.prompt_format, cfg.model)  # the worker's, for the masks
        doctor = RunDoctor(cfg, metrics_path) if rank == 0 else None  # plain-language warnings (run/doctor.py)
        progress = WorkerProgress(workers[0][1].status, cfg, doctor) if workers else None
        tracker = Tracker(cfg, run_dir) if rank == 0 and cfg.report_to != "none" else None  # tensorboard/wandb
        generated, draws = [0] * cfg.gen_workers, [0] * cfg.gen_workers  # per worker: completions made, problems drawn
        if state is not None:  # resuming: the workers take up the checkpoint's data position and weights
            draws = resume_workers(workers, state, first_step, served, cfg)
            sender.send(engine.module, first_step - 1, cfg.zero_stage, check_alive, cfg.data_timeout)
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
                if doctors_word := progress.update(step):  # the run doctor stops the run
                    raise SystemExit(doctors_word)
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
            taken = [take(step)]  # (tensors, meta): one group, ref_logps (G, C_q) added
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

            batch = collate(groups, tokenizer.pad_token_id)  # prompts (Q, P); completions, log-probs (Q*G, C)
            # the tokens the loss counts, (Q*G, C): each completion up to its stop token, never past what vLLM
            # generated (--mask_truncated_completions: none of one cut off at --max_new_tokens or the context's end)
            lengths = generated_lengths(batch["sampler_logps"])  # (Q*G,)
            batch["loss_mask"] = completion_mask(batch["completion_ids"], stop_ids, cfg.mask_truncated_completions,
                                                 lengths)
            t_ref = time.time()
            if cfg.beta != 0 and not uses_ref_server(cfg):  # LoRA: the base model, adapters off
                batch["ref_logps"] = reference_logps(engine, batch, cfg)
            ref_s = time.time() - t_ref

            # GRPO 4. the update: grpo_math.grpo_loss on the batch, one optimizer step. Its inputs: the live policy's
            # logps and old_logps (the ratio; both computed in grpo_update, old_logps detached in the first
            # iteration), advantages (make_groups, in the worker), ref_logps (the ref server: the KL term),
            # sampler_logps (vLLM's: each token's weight min(pi_old / pi_vLLM, --tis_cap); with 0 they are
            # old_logps instead) and loss_mask (just above)
            if cfg.time_phases or step == cfg.profile_step:  # the same update, timed by phase (run/phase_timer.py)
                from simple_grpo.run.phase_timer import timed_update
                update_stats, logps = timed_update(grpo_update, engine, batch, cfg, profile=step == cfg.profile_step)
            else:
                update_stats, logps = grpo_update(engine, batch, cfg)  # logps (Q*G, C): the last iteration's
            compute_s = time.time() - t0 - wait_s

            # GRPO 5. send the new weights (in memory) every --sync_every steps; the worker loads them when the
            # batch they sample is next (WorkerSchedule)
            if step % cfg.sync_every == 0 and step < cfg.steps:
                sender.send(engine.module, step, cfg.zero_stage, check_alive, cfg.data_timeout)
            record = {"step": step, **meta["rollout_figures"], **update_stats, "policy_lag": step - 1 - oldest,
                      "batch": meta["batch_index"], "worker": meta["worker"], "generated": sum(generated),
                      "trained": trained, "wait_s": wait_s, "compute_s": compute_s, "ref_s": ref_s,
                      "sync_s": time.time() - t0 - wait_s - compute_s, "step_s": time.time() - t0}
            if cfg.max_policy_lag > 1:  # the staleness of each batch this step trained on, every rank's
                record["batch_lags"] = batch_lags(metas, step, world)

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
