"""grpo_vllm_one.py: the fast GRPO trainer. vLLM generates the next batches while DeepSpeed trains.

    python ref_server.py &                 # the frozen reference model, 127.0.0.1:59875
    python grpo_vllm_one.py                # tiny default model and toy task, on CPU
    deepspeed --include localhost:0 grpo_vllm_one.py --gen_device 1 --model Qwen/Qwen2.5-0.5B ...

Two processes, one pipeline:

  generation worker (vLLM, its own device)        trainer (DeepSpeed, rank 0)
  ---------------------------------------------   ----------------------------------------
  sample G completions per prompt with their      take a batch from the ref server (FIFO)
  log-probs; score; post groups to ref server ->  (ref server adds ref_logps)
  load new weights when they come             <-  GRPO update; every sync_every steps,
                                                  send the full weights in memory

While the trainer computes step s, the worker already samples the batch for step s+1 with
slightly older weights. Each rollout carries the policy version that made it; the ratio
exp(logp - old_logp) uses the log-probs vLLM reported at sampling time, so the update stays
correct off-policy (PPO's clip bounds it), and the worker never runs more than
`max_policy_lag` versions ahead. The math, rewards, data and logging are grpo_train's.
"""
import contextlib
import dataclasses
import logging
import math
import os
import queue
import random
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from data import make_prompt, stop_token_ids
from devices import check_shared_memory, generation_gpus, max_over_ranks, physical_gpus, visible_gpus
from completions_log import log_batch_completions
from doctor import RunDoctor, batch_summary
from grpo_math import completion_mask, is_truncated
from progress import WorkerProgress
from rewards import extract_answer
from checkpoint import open_run, save_checkpoint
from grpo_train import (Config as TrainConfig, check_options, collate, grpo_update, load_data, make_engine, make_groups,
                        preflight, rollout_stats, score_groups, show_plan)
from metrics import Tracker, finish_run, log_step
from protocol import post_groups, ref_request, take_group


@dataclass
class Config(TrainConfig):
    run_name: str = "vllm_one"
    threads: int = 1  # trainer's CPU threads: the worker has its own core(s) on a CPU machine
    # vLLM's first GPU, a physical id as nvidia-smi numbers it (devices.generation_gpus); -1: the first GPU
    # no trainer rank of this node uses (on a one-GPU machine, the trainer's own)
    gen_device: int = -1
    gen_tp: int = 1  # vLLM tensor-parallel size: the worker takes gen_tp devices from gen_device on
    gen_every: int = 0  # one generation worker per this many trainer ranks (0: one per node)
    gen_threads: int = 1  # CPU machines: cores given to the worker's vLLM (the last ones)
    gen_memory: float = 0.0  # vLLM's gpu_memory_utilization; 0: 0.9 on GPUs of its own, 0.3 beside the trainer
    # truncated importance sampling: each token weighted by min(pi_old / pi_sampler, tis_cap)
    # (grpo_math.truncated_is_weight); 0: none, vLLM's log-probs are the ratio's old ones
    tis_cap: float = 2.0
    sync_every: int = 1  # optimizer steps between weight syncs to the worker
    max_policy_lag: int = 1  # the worker waits rather than sample with weights older than this
    max_model_len: int = 512
    # regroup_ver/: upload every group, all-alike ones too, and ask such a question once more when
    # its answers differ; ref_server_regroup.py pools the answers and serves groups with mixed rewards
    regroup: bool = False
    max_completions: int = 0  # stop once the worker has generated this many completions (0: run all --steps)
    startup_timeout: float = 1200.0  # seconds the generation worker may take to start vLLM (load, compile)
    # seconds the trainer waits for its next batch once vLLM is up (and the worker for new weights)
    data_timeout: float = 600.0


# ---------------------------------------------------------------------------- vLLM helpers
def start_vllm(cfg):
    """An in-process vLLM engine (no engine subprocess: weights can be handed to it directly)
    that reports the log-probs of sampled tokens after temperature, as the trainer computes them."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM
    return LLM(model=cfg.model, dtype=cfg.dtype, seed=cfg.seed, enforce_eager=not torch.cuda.is_available(),
               tensor_parallel_size=cfg.gen_tp,
               max_model_len=cfg.max_model_len, gpu_memory_utilization=cfg.gen_memory or 0.3,
               logprobs_mode="processed_logprobs")


def sample(llm, prompts, cfg, stop_ids=()):
    """G completions per prompt, each ending at its first stop token (or EOS): prompt rows [(P,)],
    completion_ids (Q*G, C) right-padded with pad, and the sampler's per-token log-probs
    old_logps (Q*G, C), group after group."""
    from vllm import SamplingParams
    params = SamplingParams(n=cfg.num_generations, temperature=cfg.temperature, max_tokens=cfg.max_new_tokens,
                            min_tokens=cfg.min_new_tokens, stop_token_ids=list(stop_ids),
                            logprobs=0)  # logprobs=0: just the sampled token's
    outputs = llm.generate(prompts, params, use_tqdm=False)
    pad = llm.get_tokenizer().pad_token_id
    completions = [c for out in outputs for c in out.outputs]
    C = max(len(c.token_ids) for c in completions)
    completion_ids = torch.full((len(completions), C), pad, dtype=torch.long)
    old_logps = torch.zeros(len(completions), C)
    for i, c in enumerate(completions):
        completion_ids[i, :len(c.token_ids)] = torch.tensor(c.token_ids)
        old_logps[i, :len(c.token_ids)] = torch.tensor([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
    prompt_rows = [torch.tensor(out.prompt_token_ids) for out in outputs]
    return prompt_rows, completion_ids, old_logps


def load_weights(llm, state_dict):
    """Copy new weights into the running engine in place. All of them, lm_head.weight included
    even when tied (vLLM on CPU keeps its own packed copy of the output layer), and fused
    groups (q/k/v, gate/up) whole. The prefix cache holds KV computed with the old weights."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state_dict.items())})
    llm.reset_prefix_cache()


# ---------------------------------------------------------------------------- weights, trainer -> worker
def weight_layout(state_dict):
    """Where each tensor sits in one flat byte buffer: {name: (offset, dtype, shape)}, and the
    buffer's size. Tied tensors (embeddings = lm_head) share one place."""
    layout, places, size = {}, {}, 0
    for name, t in state_dict.items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape))
        if key not in places:
            places[key] = size
            size += -(-t.numel() * t.element_size() // 64) * 64  # keep every tensor 64-byte aligned
        layout[name] = (places[key], t.dtype, tuple(t.shape))
    return layout, size


def tensors_in(buffer, layout):
    """The state dict as views into the flat buffer (no copy)."""
    return {name: buffer[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for name, (offset, dtype, shape) in layout.items()}


class WeightSender:
    """The trainer's end of the weight sync, all in memory.

    The weights are copied into a flat buffer in shared memory that both processes map, and
    only (version, buffer index) goes through the queue: one memcpy per sync, no pickling of
    tensors, no allocation after the first. Two buffers are used in turn, and one is refilled
    only after the worker has loaded the version it held (`loaded`, a shared integer), so the
    worker never reads weights that are being overwritten."""

    def __init__(self, weights_queue, loaded):
        self.queue, self.loaded = weights_queue, loaded
        self.buffers, self.held, self.layout, self.syncs = None, [-1, -1], None, 0

    def send(self, module, version, zero_stage=0, check_alive=lambda: None, timeout=600.0):
        gather = contextlib.nullcontext()
        if zero_stage == 3:  # ZeRO-3 keeps each parameter in shards: gather them whole first
            import deepspeed
            gather = deepspeed.zero.GatheredParameters(list(module.parameters()))
        with gather, torch.no_grad():
            state_dict = module.state_dict()
            if self.buffers is None:  # first sync: allocate, and hand the worker the buffers once
                self.layout, size = weight_layout(state_dict)
                check_shared_memory(2 * size)
                self.buffers = [torch.empty(size, dtype=torch.uint8).share_memory_() for _ in range(2)]
                self.queue.put(("buffers", self.buffers, self.layout))
            i, self.syncs = self.syncs % 2, self.syncs + 1
            deadline = time.time() + timeout
            while self.loaded.value < self.held[i]:  # the worker still needs what this buffer holds
                check_alive()
                if time.time() > deadline:
                    raise SystemExit(f"the generation worker has not loaded weights version {self.held[i]} in "
                                     f"{timeout:.0f} s (--data_timeout): see its log above")
                time.sleep(0.001)
            for name, view in tensors_in(self.buffers[i], self.layout).items():
                view.copy_(state_dict[name])
        self.held[i] = version
        self.queue.put(("weights", version, i))


def receive_weights(llm, message, shared, loaded):
    """The worker's end: a sync message is either the buffers (once), kept in `shared`, or
    (version, buffer index) to load into vLLM. Returns the version loaded, or None."""
    if message[0] == "buffers":
        shared["buffers"], shared["layout"] = message[1], message[2]
        return None
    _, version, i = message
    load_weights(llm, tensors_in(shared["buffers"][i], shared["layout"]))
    loaded.value = version
    return version


# ---------------------------------------------------------------------------- generation worker
def gen_worker(cfg, run_id, ranks, weights_queue, groups_queue, status_queue, loaded, stop, parent_pid):
    """The worker process: sample, score, post groups to the ref server (or, with beta 0, hand
    them to the trainer through groups_queue) for the trainer ranks `ranks`; take new weights.
    Every batch, kept or dropped, is reported on status_queue (progress.py)."""
    def watch_parent():  # a trainer killed without clean-up must not leave this process behind
        while os.getppid() == parent_pid:
            time.sleep(1)
        os._exit(1)
    threading.Thread(target=watch_parent, daemon=True).start()

    # the trainer notices a dead ref server first, and names it, if this process waits longer
    cfg = dataclasses.replace(cfg, peer_timeout=cfg.peer_timeout + 15)
    t0 = time.time()
    llm = start_vllm(cfg)
    status_queue.put(("ready", time.time() - t0))
    logging.getLogger("vllm").setLevel(logging.ERROR)  # started: its per-reload notes would flood the log
    tokenizer = llm.get_tokenizer()
    stop_ids = stop_token_ids(tokenizer, cfg.prompt_format)
    weights, problems = check_options(cfg), load_data(cfg)  # this process loads the reward file too
    rng, G = random.Random(cfg.seed + ranks[0]), cfg.num_generations  # each worker its own draws
    # version: trainer steps in the loaded weights (None: resuming, the checkpoint's are on their way);
    # draws: batches of problems taken from rng so far, the data position a checkpoint records
    version, batch, draws, shared, load_s = (None if cfg.resume else 0), 0, 0, {}, 0.0
    generated, ask_again = 0, []  # completions made so far; regroup: questions to ask once more
    world = int(os.environ.get("WORLD_SIZE", "1"))
    n = len(ranks)  # batch b goes to rank ranks[b % n]
    waiting_since = None  # when the worker began waiting for new weights
    while not stop.is_set():
        # bounded staleness: batch b is trained at trainer step b+1, by weights of version b
        # (regroup: the server evicts old answers instead, and answers 503 when enough are ready)
        must_wait = version is None or (not cfg.regroup and batch // n - version > cfg.max_policy_lag)
        try:
            message = weights_queue.get(timeout=1.0) if must_wait else weights_queue.get_nowait()
        except queue.Empty:
            message = None
        waiting_since = (waiting_since or time.time()) if must_wait and message is None else None
        if waiting_since is not None and time.time() - waiting_since > cfg.data_timeout:
            raise SystemExit(f"generation worker: no new weights from the trainer in {cfg.data_timeout:.0f} s "
                             f"(it has version {version}, needs {batch // n - cfg.max_policy_lag})")
        if message is not None and message[0] == "resume":  # continue at the checkpoint's step and data
            _, batch, draws = message
            for _ in range(draws):
                rng.sample(problems, cfg.batch_prompts)
        elif message is not None:  # load all weights that came before sampling more
            t0 = time.time()
            if (new_version := receive_weights(llm, message, shared, loaded)) is not None:
                version, load_s = new_version, time.time() - t0
        if message is not None or must_wait:
            continue

        t0 = time.time()
        batch_problems, draws = rng.sample(problems, cfg.batch_prompts) + ask_again, draws + 1
        prompts = [make_prompt(tokenizer, p["question"], cfg.prompt_format) for p in batch_problems]
        prompt_rows, completion_ids, old_logps = sample(llm, prompts, cfg, stop_ids)
        mask = completion_mask(completion_ids, stop_ids)
        texts = tokenizer.batch_decode(completion_ids * mask.long() + tokenizer.pad_token_id * (1 - mask.long()),
                                       skip_special_tokens=True)
        gen_s = time.time() - t0
        rewards, scores = score_groups(texts, batch_problems, G, weights)
        meta = {"run_id": rank_run_id(run_id, ranks[batch % n], world, cfg.regroup), "policy_version": version,
                "temperature": cfg.temperature}
        groups, has_signal = make_groups(prompt_rows, completion_ids, mask, rewards, G, meta, old_logps,
                                         keep_equal=cfg.regroup, scale_rewards=cfg.scale_rewards, scores=scores)
        generated += completion_ids.size(0)
        stats = {**rollout_stats(rewards, scores, mask, has_signal, gen_s, is_truncated(completion_ids, stop_ids)),
                 "weights_load_s": load_s, "generated": generated}
        status_queue.put(("batch", {**batch_summary(rewards, scores, texts, has_signal), "posted": len(groups)}))
        if cfg.regroup:  # a second round for the fresh questions whose answers all scored alike but
            # differ: the model is unsure of those, and another round may bring another reward
            answers = [extract_answer(text) for text in texts]
            ask_again = [p for q, p in enumerate(batch_problems[:cfg.batch_prompts])
                         if not has_signal[q] and len(set(answers[q * G:(q + 1) * G])) > 1]
        for _, m in groups:  # the trainer takes groups_in_batch groups as one batch
            m.update(batch=batch, draws=draws, groups_in_batch=len(groups), stats=stats)
        if groups and uses_ref_server(cfg):
            post_groups(cfg, groups)
        for group in groups if not uses_ref_server(cfg) else []:
            groups_queue.put(group)  # local: tensors travel in shared memory, nothing is pickled over a network
        batch += bool(groups)


def rank_run_id(run_id, rank, world, regroup):
    """The run_id a rank's batches carry: the server hands each rank its own (regroup: any rank
    takes any group, each a whole group)."""
    return run_id if world == 1 or regroup else f"{run_id}-{rank}"


def sync_weights(sender, engine, version, cfg, check_alive):
    """Every rank calls it: under ZeRO-3 every rank takes part in gathering the weights whole;
    each rank that runs a worker (sender not None) sends them to it."""
    if sender is not None:
        sender.send(engine.module, version, cfg.zero_stage, check_alive, cfg.data_timeout)
    elif cfg.zero_stage == 3:
        import deepspeed
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            pass


def uses_ref_server(cfg):
    """The KL term needs the reference server's log-probs; regrouping needs its pools."""
    return cfg.beta != 0 or cfg.regroup


def take_local_group(groups_queue, waiting):
    """take_group's local twin (beta 0): the worker's next group; waiting(waited_s) runs while none is there."""
    start = time.time()
    while True:
        try:
            return groups_queue.get(timeout=1.0)
        except queue.Empty:
            waiting(time.time() - start)


def local_world_size(default):
    """Trainer ranks on this node, as the launcher says: LOCAL_SIZE (deepspeed) or LOCAL_WORLD_SIZE
    (torchrun). vLLM on CPU sets LOCAL_WORLD_SIZE in its own process (to its tensor-parallel size),
    and a process started from there inherits it: it counts only under torchrun."""
    if "LOCAL_SIZE" in os.environ:
        return int(os.environ["LOCAL_SIZE"])
    if "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return default


def start_worker(cfg, run_id, ranks):
    """Spawn a generation worker for the trainer ranks `ranks` on its own device(s) (CUDA) or its
    own cores (CPU)."""
    ctx = mp.get_context("spawn")
    weights_queue, groups_queue, status_queue = ctx.Queue(), ctx.Queue(), ctx.Queue()
    loaded, stop = ctx.Value("i", 0), ctx.Event()
    env = {"OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}
    if torch.cuda.is_available():
        # this node's trainer ranks use the first local_size visible GPUs; vLLM takes gen_tp GPUs by
        # physical id (devices.generation_gpus), numbered in nvidia-smi's (PCI) order
        physical = physical_gpus()
        trainer_gpus = visible_gpus(physical)[:local_world_size(1)]
        gpus, shared_gpu = generation_gpus(cfg.gen_device, cfg.gen_tp, trainer_gpus, physical)
        cfg = dataclasses.replace(cfg, gen_memory=cfg.gen_memory or (0.3 if shared_gpu else 0.9))
        env.update(CUDA_VISIBLE_DEVICES=",".join(map(str, gpus)), CUDA_DEVICE_ORDER="PCI_BUS_ID")
        print(f"generation worker: vLLM on GPU {gpus} (gpu_memory_utilization {cfg.gen_memory}), "
              f"trainer on GPU {trainer_gpus}")
    else:
        cores = sorted(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores[-cfg.gen_threads:]))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # a spawned child takes the parent's environment at start
    try:
        worker = ctx.Process(target=gen_worker, args=(cfg, run_id, ranks, weights_queue, groups_queue, status_queue,
                                                      loaded, stop, os.getpid()), name="gen_worker")
        worker.start()
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return worker, WeightSender(weights_queue, loaded), groups_queue, status_queue, stop


def stop_worker(worker, stop):
    stop.set()
    worker.join(timeout=10)
    if worker.is_alive():
        worker.kill()
        worker.join(timeout=10)


# ---------------------------------------------------------------------------- training
def main(cfg: Config):
    if cfg.max_policy_lag < cfg.sync_every - 1:
        raise SystemExit(f"max_policy_lag={cfg.max_policy_lag} < sync_every-1={cfg.sync_every - 1}: the worker would "
                         f"wait for weights the trainer cannot make without its batches")
    # several ranks (deepspeed --num_gpus N): each node's local rank 0 (or every gen_every-th rank)
    # runs a generation worker that makes a batch per rank it serves, tagged with that rank's run_id;
    # the ref server hands each rank its own; DeepSpeed averages the gradients
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not uses_ref_server(cfg):
        raise SystemExit("several ranks take their batches from the ref server: use --beta > 0 (or one rank)")
    check_options(cfg)  # bad options and data fail here, before any process starts
    load_data(cfg)
    show_plan(cfg)
    if uses_ref_server(cfg):
        ref_request(cfg, "GET", "/health")  # fail fast, with a clear message, if the server is absent
    if cfg.preflight and rank == 0:
        preflight(cfg)
    run_id = uuid.uuid4().hex  # tells this run's groups from any another run left in the server
    # one worker per gen_every ranks (default: per node, on its local rank 0) serves those ranks
    every = cfg.gen_every or local_world_size(world)
    served = list(range(rank, min(rank + every, world)))
    if cfg.regroup and every < world:
        raise SystemExit("--regroup takes one generation worker: set --gen_every to the number of ranks")
    worker, sender, groups_queue, status_queue, stop_event = (start_worker(cfg, run_id, served) if rank % every == 0
                                                              else (None,) * 5)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up below on `kill` too

    def check_worker():
        if worker is not None and not worker.is_alive():
            raise SystemExit(f"generation worker (pid {worker.pid}) died with exit code {worker.exitcode}: "
                             f"see its log above")

    def take(step):
        """The next group for this rank; while it waits, the bar says what for and the worker's progress."""
        def waiting(waited_s):
            check_worker()
            if progress is None:  # a rank without a worker: another rank's worker fills the ref server
                deadline = cfg.data_timeout + (cfg.startup_timeout if step == first_step else 0)
                if waited_s > deadline:
                    raise SystemExit(f"no batch for rank {rank} came from the ref server in {deadline:.0f} s")
                return
            stop = progress.update(step)
            if stop:
                raise SystemExit(stop)
            bar.set_description_str(progress.describe(step, waited_s))
            progress.check_deadline(waited_s)
        if uses_ref_server(cfg):
            return take_group(cfg, rank_run_id(run_id, rank, world, cfg.regroup), None, waiting, step - 1)
        return take_local_group(groups_queue, waiting)

    try:
        engine, tokenizer = make_engine(cfg)
        if world > 1:  # every rank takes its batches under the run_id of the worker that serves it
            run_ids = [None] * world
            dist.all_gather_object(run_ids, run_id)
            run_id = run_ids[rank - rank % every]
        run_dir, metrics_path, first_step, state = open_run(cfg, engine)
        stop_ids = stop_token_ids(tokenizer, cfg.prompt_format)
        doctor = RunDoctor(cfg, metrics_path) if rank == 0 else None  # plain-language warnings (doctor.py)
        progress = WorkerProgress(status_queue, cfg, doctor) if worker is not None else None  # progress.py
        tracker = Tracker(cfg, run_dir) if rank == 0 else None  # --report_to tensorboard/wandb
        if state is not None:  # resuming: the worker takes up the checkpoint's data position and weights
            if sender is not None:
                sender.queue.put(("resume", (first_step - 1) * len(served), state["draws"]))
            sync_weights(sender, engine, first_step - 1, cfg, check_worker)
        bar = tqdm(range(first_step, cfg.steps + 1), desc="grpo (vllm)", initial=first_step - 1, total=cfg.steps,
                   disable=rank != 0)
        generated, trained, stop = 0, 0, None  # completions: made by the worker, in a trained group; doctor's stop
        for step in bar:
            # 1. the next batch of groups the worker made, with ref_logps from the server
            t0 = time.time()
            taken = [take(step)]
            n_groups = cfg.batch_prompts if cfg.regroup else taken[0][1]["groups_in_batch"]
            taken += [take(step) for _ in range(n_groups - 1)]
            groups, metas = [g for g, _ in taken], [m for _, m in taken]
            wait_s = time.time() - t0
            bar.set_description_str("grpo (vllm)")
            meta, oldest = metas[-1], min(m["policy_version"] for m in metas)
            trained += sum(g["completion_ids"].size(0) for g in groups)
            generated = max([generated] + [m["stats"]["generated"] for m in metas])

            # 2. the GRPO update; old_logps are vLLM's, from the policy version that sampled
            batch = collate(groups, tokenizer.pad_token_id)
            stats, logps = grpo_update(engine, batch, cfg, stop_ids)
            compute_s = time.time() - t0 - wait_s

            # 3. new weights to the worker, in memory
            if step % cfg.sync_every == 0 and step < cfg.steps:
                sync_weights(sender, engine, step, cfg, check_worker)
            record = {"step": step, **meta["stats"], **stats, "policy_lag": step - 1 - oldest,
                      "generated": generated, "trained": trained,
                      "wait_s": wait_s, "compute_s": compute_s, "sync_s": time.time() - t0 - wait_s - compute_s,
                      "step_s": time.time() - t0}
            stop = progress.update(step) if progress is not None else None  # the batches made meanwhile
            if rank == 0:  # rank 0's own batch and loss, a few of its completions, what the doctor makes of them
                log_step(metrics_path, record, tracker)
                if cfg.log_completions_every and step % cfg.log_completions_every == 0:
                    log_batch_completions(run_dir, step, tokenizer, batch, [s for m in metas for s in m["scores"]],
                                          stop_ids, logps)
                stop = doctor.step(record) or stop
            bar.set_postfix(reward=f"{record['reward_mean']:.2f}", acc=f"{record['accuracy']:.2f}",
                            kl=f"{record['kl']:.3f}", lag=record["policy_lag"], wait=f"{wait_s:.2f}")
            last = bool(max_over_ranks(step == cfg.steps or 0 < cfg.max_completions <= generated or bool(stop)))
            if step % cfg.save_every == 0 or last:  # the data position after every rank's batch
                draws = int(max_over_ranks(meta["draws"]))
                save_checkpoint(engine, tokenizer, run_dir, step, {"draws": draws})
            if last:
                break
    finally:
        if worker is not None:
            stop_worker(worker, stop_event)
    finish_run(run_dir, step, rank, tracker)
    if stop:
        raise SystemExit(stop)


if __name__ == "__main__":
    from transformers import HfArgumentParser
    (config,) = HfArgumentParser(Config).parse_args_into_dataclasses()
    main(config)
