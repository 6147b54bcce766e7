"""The full trainer's generation workers as its trainer sees them: spawned processes that talk to it only through
their Channels; which makes which rank's batch; what they report while the trainer waits; their stop."""
import dataclasses
import os
import queue
import signal
import sys
import threading
import time
from typing import Any
from unittest import mock

import torch
import torch.multiprocessing as mp
from tqdm import tqdm

from simple_grpo.devices import generation_gpus, physical_gpus, reference_gpus, visible_gpus, vllm_memory_share
from simple_grpo.protocol import TOKEN_ENV


@dataclasses.dataclass
class Channels:
    weights: Any  # trainer -> this worker: ("buffers", ...) once, then ("weights", version, i); ("resume", ...)
    groups: Any  # this worker -> trainer where no ref server is used (--beta 0, or LoRA without --ref_url)
    status: Any  # every worker -> trainer, one queue: ("ready", seconds), then ("batch", summary) per batch
    loaded: Any  # shared int: the newest weight version this worker has loaded or passed over (weight_sync)
    stop: Any  # one event for all workers: the trainer asks them to finish
    shares_gpu: bool = False  # its vLLM runs on a GPU a trainer rank of this node uses (wait_for_vllm)


def local_world_size(default):
    """Trainer ranks on this node: LOCAL_SIZE (deepspeed), or LOCAL_WORLD_SIZE under torchrun only (vLLM on CPU
    sets it in its own process too)."""
    if "LOCAL_SIZE" in os.environ:
        return int(os.environ["LOCAL_SIZE"])
    if "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return default


def stream_id(run_id, rank, world, cfg, worker):
    """The run_id a batch travels under: the ref server hands each rank its own, and each worker's apart, so two
    batches' groups never mix (--regroup: any rank takes any group)."""
    if cfg.regroup:
        return run_id
    return run_id + (f"-{rank}" if world > 1 else "") + (f"-w{worker}" if cfg.gen_workers > 1 else "")


def batch_worker(step, rank, served, cfg):
    """Which worker makes the batch of `step` for `rank`: a worker set makes batches b = 0, 1, 2, ... in turn for
    its ranks `served` (b -> rank served[b % len(served)]), worker b % gen_workers."""
    return ((step - 1) * len(served) + served.index(rank)) % cfg.gen_workers


def start_workers(target, cfg, *args):
    """Spawn cfg.gen_workers processes (fresh interpreters: CUDA and vLLM start cleanly), worker k running
    target(cfg, *args, k, channels_k) where place_worker puts it. Returns [(process, channels)]."""
    ctx = mp.get_context("spawn")
    status, stop = ctx.Queue(), ctx.Event()
    workers = []
    for k in range(cfg.gen_workers):
        channels = Channels(weights=ctx.Queue(), groups=ctx.Queue(), status=status, loaded=ctx.Value("i", 0),
                            stop=stop)
        worker_cfg, env, cores, channels.shares_gpu = place_worker(cfg, k)
        with mock.patch.dict(os.environ, env):  # a spawned child takes the parent's environment at start
            worker = ctx.Process(target=run_on_cores, name=f"gen_worker_{k}",
                                 args=(cores, os.getpid(), target, worker_cfg, *args, k, channels))
            worker.start()
        print(f"generation worker {k}: pid {worker.pid}")
        workers.append((worker, channels))
    return workers


def place_worker(cfg, k):
    """Worker k's config and environment (which GPUs its vLLM sees), the CPU cores to pin it to (None on a
    GPU machine), and whether it shares a GPU with a trainer rank. --gen_device -1 leaves out the GPU a
    reference server on this machine reports in its /health."""
    env = {"OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}
    if torch.cuda.is_available():
        # this node's trainer ranks use the first local_size visible GPUs; vLLM takes gen_tp GPUs by
        # physical id (devices.generation_gpus), numbered in nvidia-smi's (PCI) order
        physical = physical_gpus()
        trainer_gpus = visible_gpus(physical)[:local_world_size(1)]
        busy = reference_gpus(cfg.ref_url, cfg.ref_token or os.environ.get(TOKEN_ENV, ""))
        gpus, shared_gpu = generation_gpus(cfg.gen_device, cfg.gen_tp, trainer_gpus, physical, k, cfg.gen_workers,
                                           busy)
        cfg = dataclasses.replace(cfg, gen_memory=vllm_memory_share(cfg.gen_memory, shared_gpu))
        env.update(CUDA_VISIBLE_DEVICES=",".join(map(str, gpus)), CUDA_DEVICE_ORDER="PCI_BUS_ID")
        print(f"generation worker {k}: vLLM on GPU {gpus} (gpu_memory_utilization {cfg.gen_memory}), "
              f"trainer on GPU {trainer_gpus}" + (f", reference server on GPU {busy[0]}" if busy else ""))
        return cfg, env, None, shared_gpu
    for name, unset in (("gen_device", -1), ("gen_memory", 0.0)):  # GPU flags: refused, not ignored, on a CPU
        if getattr(cfg, name) != unset:
            raise SystemExit(f"--{name} {getattr(cfg, name)}: this machine has no GPU, and vLLM runs on CPU cores "
                             f"(--gen_threads; its KV cache: VLLM_CPU_KVCACHE_SPACE in GiB)")
    # worker k takes the gen_threads cores before worker k-1's, wrapping round on a small machine.
    # OMP_NUM_THREADS caps every OpenMP runtime in the process, vLLM's CPU kernels' own too
    cores, t = sorted(os.sched_getaffinity(0)), cfg.gen_threads
    mine = [cores[(len(cores) - (k + 1) * t + i) % len(cores)] for i in range(t)]
    env["OMP_NUM_THREADS"] = str(t)
    print(f"generation worker {k}: vLLM on CPU core(s) {mine}")
    return cfg, env, mine, False


def run_on_cores(cores, parent_pid, target, *args):
    """The worker process's entry: pinned to its cores (every thread it starts too), it exits through Python on
    SIGTERM (its multiprocessing objects released), and within a second of the trainer's end (watch_parent)."""
    if cores is not None:
        os.sched_setaffinity(0, cores)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    def watch_parent():  # the watchdog: exit once the trainer is gone, killed without clean-up
        while os.getppid() == parent_pid:
            time.sleep(1)
        os._exit(1)
    threading.Thread(target=watch_parent, daemon=True).start()
    target(*args)


def check_workers(workers):
    """Stop the run, naming the worker, if any generation worker has died."""
    for k, (worker, _) in enumerate(workers):
        if not worker.is_alive():
            raise SystemExit(f"generation worker {k} (pid {worker.pid}) died with exit code {worker.exitcode}: "
                             f"see its log above")


def stop_workers(workers, grace=10):
    """Ask the workers to finish; one that has not within `grace` s gets SIGTERM, and SIGKILL `grace` s later.
    A second Ctrl-C or SIGTERM cuts the waits short and kills at once."""
    if workers:
        workers[0][1].stop.set()  # one event for all
    try:
        join_all(workers, grace)
        for worker, _ in workers:
            worker.terminate()  # a no-op on one that has exited
        join_all(workers, grace)
    finally:
        for worker, _ in workers:
            worker.kill()
            worker.join(timeout=10)


def join_all(workers, seconds):
    deadline = time.time() + seconds
    for worker, _ in workers:
        worker.join(timeout=max(deadline - time.time(), 0))


def wait_for_vllm(workers, cfg):
    """Where a worker's vLLM shares a GPU with this trainer (or with --startup_order vllm_first), wait until every
    worker has vLLM up before the trainer loads its model: vLLM sizes its KV cache from the GPU's free memory as it
    profiles, and fails if that rose meanwhile. Stops the run after --startup_timeout; puts the ready messages back."""
    order = cfg.startup_order
    if not workers or order == "together" or (order == "auto" and not any(c.shares_gpu for _, c in workers)):
        return
    status, started, taken = workers[0][1].status, time.time(), []
    why = ("vLLM shares this trainer's GPU and measures its free memory" if order == "auto"
           else "--startup_order vllm_first")
    print(f"waiting for the generation worker's vLLM to start before the trainer loads its model ({why}; "
          f"gives up after {cfg.startup_timeout:.0f} s)")
    while sum(kind == "ready" for kind, _ in taken) < len(workers):
        if time.time() - started > cfg.startup_timeout:
            raise SystemExit(f"vLLM did not start in {cfg.startup_timeout:.0f} s (--startup_timeout), and the trainer "
                             f"loads its model only once it has ({why}): see the generation worker's log above")
        check_workers(workers)
        try:
            taken.append(status.get(timeout=1.0))
        except queue.Empty:
            pass
    print(f"vLLM is up after {time.time() - started:.0f} s: the trainer loads its model now")
    for message in taken:
        status.put(message)


def resume_workers(workers, state, first_step, served, cfg):
    """Send each worker the checkpoint's batch number and its problem draws (it replays them); returns the draws."""
    draws = state["draws"] if isinstance(state["draws"], list) else [state["draws"]]  # older checkpoints: a number
    if len(draws) != cfg.gen_workers:
        raise SystemExit(f"the checkpoint was made with --gen_workers {len(draws)}: resume with the same number "
                         f"(each worker continues its own problem draws)")
    next_batch = (first_step - 1) * len(served)
    for k, (_, channels) in enumerate(workers):
        channels.weights.put(("resume", next_batch + (k - next_batch) % cfg.gen_workers, draws[k]))
    return draws


def take_local_group(groups_queue, waiting):
    """take_group's local twin (no ref server): the worker's next group; waiting(waited_s) runs while none is there."""
    start = time.time()
    while True:
        try:
            return groups_queue.get(timeout=1.0)
        except queue.Empty:
            waiting(time.time() - start)


class WorkerProgress:
    """The workers' status messages as the trainer reads them: each batch to the run doctor, the progress bar's text
    while it waits, and a deadline naming what never came."""

    def __init__(self, status_queue, cfg, doctor):
        self.queue, self.cfg, self.doctor = status_queue, cfg, doctor
        self.started, self.ready_at = time.time(), None
        # batches sampled; of them, with no group kept (and how many of the latest in a row); groups sent on
        self.batches, self.dropped, self.dropped_in_row, self.posted = 0, 0, 0, 0
        self.last = None  # the latest batch's summary

    def update(self, step):
        """Take the workers' new messages; the doctor reads each batch. Returns the doctor's stop message, or None."""
        stop = None
        while True:
            try:
                kind, body = self.queue.get_nowait()
            except queue.Empty:
                return stop
            if kind == "ready":
                self.ready_at = time.time()
                tqdm.write(f"generation worker: vLLM ready after {body:.0f} s")
                continue
            self.batches, self.posted, self.last = self.batches + 1, self.posted + body["posted"], body
            self.dropped += body["posted"] == 0
            self.dropped_in_row = self.dropped_in_row + 1 if body["posted"] == 0 else 0
            if self.doctor is not None:
                stop = self.doctor.batch(body, step) or stop

    def describe(self, step, waited_s):
        """The progress bar's text while the trainer waits for the batch of `step`."""
        if self.ready_at is None:
            return (f"waiting for the generation worker to start vLLM ({time.time() - self.started:.0f} s, "
                    f"gives up after {self.cfg.startup_timeout:.0f} s)")
        text = f"waiting for step {step}'s batch ({waited_s:.0f} s): worker made {self.batches} batches"
        if self.dropped:
            text += f", {self.dropped} dropped whole (all groups all-alike)"
        if self.last is not None:
            text += f", last reward mean {sum(self.last['rewards']) / len(self.last['rewards']):.2f}"
        return text

    def check_deadline(self, waited_s):
        """Stop the run, naming what never came, when a wait has gone on too long."""
        now, cfg = time.time(), self.cfg
        if self.ready_at is None and now - self.started > cfg.startup_timeout:
            raise SystemExit(f"the generation worker has not started vLLM in {cfg.startup_timeout:.0f} s "
                             f"(model {cfg.model}): see its log above; a large model may need a longer "
                             "--startup_timeout")
        if self.ready_at is None or min(waited_s, now - self.ready_at) <= cfg.data_timeout:  # waited since vLLM was up
            return
        if self.batches == 0:
            what = "the worker has sampled no batch at all since vLLM started: see its log above"
        elif self.dropped_in_row:
            what = (f"the worker's last {self.dropped_in_row} batches (of {self.batches}) were all dropped: no group "
                    f"had reward variance (rewards in the last: {sorted(set(self.last['rewards']))[:5]}); see the run "
                    "doctor's no_signal warning above")
        else:
            what = (f"the worker sampled {self.batches} batches and sent {self.posted} groups"
                    + (", but the ref server returned none for this step: see its log" if cfg.beta != 0 or cfg.regroup
                       else ""))
        raise SystemExit(f"no trainable batch came in {cfg.data_timeout:.0f} s (--data_timeout): {what}")
