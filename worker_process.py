"""The generation worker as a process: started on its own GPU(s) or CPU cores, watched, stopped.

grpo_vllm_one.py's gen_worker runs in a spawned process (a fresh interpreter, so CUDA and vLLM
start cleanly) and talks to the trainer only through the Channels below. It exits when the
trainer asks (channels.stop), and on its own when the trainer is gone (watch_parent), so no
worker outlives its run.
"""
import dataclasses
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp

from devices import generation_gpus, physical_gpus, visible_gpus, vllm_memory_share


@dataclass
class Channels:
    weights: Any  # trainer -> worker queue: ("buffers", ...) once, then ("weights", version, i); ("resume", ...)
    groups: Any  # worker -> trainer queue, beta 0 only: finished groups (no ref server between them)
    status: Any  # worker -> trainer queue: ("ready", seconds), then ("batch", summary) per batch (progress.py)
    loaded: Any  # shared int: the weight version the worker has loaded (weight_sync.WeightSender)
    stop: Any  # event: the trainer asks the worker to finish


def local_world_size(default):
    """Trainer ranks on this node, as the launcher says: LOCAL_SIZE (deepspeed) or LOCAL_WORLD_SIZE
    (torchrun). vLLM on CPU sets LOCAL_WORLD_SIZE in its own process (to its tensor-parallel size),
    and a process started from there inherits it: it counts only under torchrun."""
    if "LOCAL_SIZE" in os.environ:
        return int(os.environ["LOCAL_SIZE"])
    if "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return default


def start_worker(target, cfg, *args):
    """Spawn target(cfg, *args, channels, parent_pid) on its own device(s) (CUDA: cfg.gen_device,
    cfg.gen_tp) or its own cores (CPU: the last cfg.gen_threads). Returns the process and its Channels."""
    ctx = mp.get_context("spawn")
    channels = Channels(weights=ctx.Queue(), groups=ctx.Queue(), status=ctx.Queue(), loaded=ctx.Value("i", 0),
                        stop=ctx.Event())
    env = {"OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}
    if torch.cuda.is_available():
        # this node's trainer ranks use the first local_size visible GPUs; vLLM takes gen_tp GPUs by
        # physical id (devices.generation_gpus), numbered in nvidia-smi's (PCI) order
        physical = physical_gpus()
        trainer_gpus = visible_gpus(physical)[:local_world_size(1)]
        gpus, shared_gpu = generation_gpus(cfg.gen_device, cfg.gen_tp, trainer_gpus, physical)
        cfg = dataclasses.replace(cfg, gen_memory=vllm_memory_share(cfg.gen_memory, shared_gpu))
        env.update(CUDA_VISIBLE_DEVICES=",".join(map(str, gpus)), CUDA_DEVICE_ORDER="PCI_BUS_ID")
        print(f"generation worker: vLLM on GPU {gpus} (gpu_memory_utilization {cfg.gen_memory}), "
              f"trainer on GPU {trainer_gpus}")
    else:
        cores = sorted(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores[-cfg.gen_threads:]))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # a spawned child takes the parent's environment at start
    try:
        worker = ctx.Process(target=target, args=(cfg, *args, channels, os.getpid()), name="gen_worker")
        worker.start()
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return worker, channels


def watch_parent(parent_pid):
    """In the worker: exit as soon as the trainer that started it is gone (killed without clean-up)."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(1)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def stop_worker(worker, channels):
    """Ask the worker to finish; kill it if it has not within 10 s, or at once if a second Ctrl-C or
    SIGTERM cuts the wait short (else the interpreter's exit would wait for it, unbounded)."""
    channels.stop.set()
    try:
        worker.join(timeout=10)
    finally:
        if worker.is_alive():
            worker.kill()
            worker.join(timeout=10)


def take_local_group(groups_queue, waiting):
    """take_group's local twin (beta 0): the worker's next group; waiting(waited_s) runs while none is there."""
    start = time.time()
    while True:
        try:
            return groups_queue.get(timeout=1.0)
        except queue.Empty:
            waiting(time.time() - start)
