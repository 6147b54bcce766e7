"""The generation workers as processes: started on their own GPU(s) or CPU cores, watched, stopped.

grpo_vllm_one.py's gen_worker runs in spawned processes (fresh interpreters, so CUDA and vLLM
start cleanly), --gen_workers of them, each talking to the trainer only through its Channels
below. They exit when the trainer asks (channels.stop), and on their own when the trainer is
gone (watch_parent), so no worker outlives its run.
"""
import dataclasses
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp

from simple_grpo.devices import generation_gpus, physical_gpus, reference_gpus, visible_gpus, vllm_memory_share
from simple_grpo.protocol import TOKEN_ENV


@dataclass
class Channels:
    weights: Any  # trainer -> this worker: ("buffers", ...) once, then ("weights", version, i); ("resume", ...)
    groups: Any  # this worker -> trainer, beta 0 only: finished groups (no ref server between them)
    status: Any  # every worker -> trainer, one queue: ("ready", seconds), then ("batch", summary) per batch
    loaded: Any  # shared int: the newest weight version this worker has loaded or passed over (weight_sync)
    stop: Any  # event, one for all workers: the trainer asks them to finish
    shares_gpu: bool = False  # its vLLM runs on a GPU a trainer rank of this node uses (wait_for_vllm)


def local_world_size(default):
    """Trainer ranks on this node, as the launcher says: LOCAL_SIZE (deepspeed) or LOCAL_WORLD_SIZE
    (torchrun). vLLM on CPU sets LOCAL_WORLD_SIZE in its own process (to its tensor-parallel size),
    and a process started from there inherits it: it counts only under torchrun."""
    if "LOCAL_SIZE" in os.environ:
        return int(os.environ["LOCAL_SIZE"])
    if "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return default


def start_workers(target, cfg, *args):
    """Spawn cfg.gen_workers processes, worker k running target(cfg, *args, k, channels_k, parent_pid),
    each on its own GPU(s) (from cfg.gen_device, cfg.gen_tp at a time) or its own core(s) (CPU: the
    last cfg.gen_threads for worker 0, the ones before for worker 1, ...). Returns [(process, channels)]."""
    ctx = mp.get_context("spawn")
    status, stop = ctx.Queue(), ctx.Event()
    workers = []
    for k in range(cfg.gen_workers):
        channels = Channels(weights=ctx.Queue(), groups=ctx.Queue(), status=status, loaded=ctx.Value("i", 0),
                            stop=stop)
        worker_cfg, env, cores, channels.shares_gpu = place_worker(cfg, k)
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)  # a spawned child takes the parent's environment at start
        try:
            worker = ctx.Process(target=run_on_cores, name=f"gen_worker_{k}",
                                 args=(cores, target, worker_cfg, *args, k, channels, os.getpid()))
            worker.start()
        finally:
            for name, value in saved.items():
                os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)
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
    # OMP_NUM_THREADS caps every OpenMP runtime in the process: vLLM's CPU kernels bring their own,
    # which torch.set_num_threads does not reach (unset, it ran one thread per core of the machine)
    cores, t = sorted(os.sched_getaffinity(0)), cfg.gen_threads
    mine = [cores[(len(cores) - (k + 1) * t + i) % len(cores)] for i in range(t)]
    env["OMP_NUM_THREADS"] = str(t)
    print(f"generation worker {k}: vLLM on CPU core(s) {mine}")
    return cfg, env, mine, False


def run_on_cores(cores, target, *args):
    """The worker process's entry: keep it, and every thread it starts, on its cores; then run target.
    (vLLM's own VLLM_CPU_OMP_THREADS_BIND binds only the engine processes it spawns, not an
    in-process engine like ours.)"""
    if cores is not None:
        os.sched_setaffinity(0, cores)
    # stop_workers' SIGTERM exits through Python, so the worker's multiprocessing objects are released
    # (killed outright, it leaves the resource tracker a "leaked semaphore" warning to print after the run's last line)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    target(*args)


def watch_parent(parent_pid):
    """In the worker: exit as soon as the trainer that started it is gone (killed without clean-up)."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(1)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def check_workers(workers):
    """Stop the run, naming the worker, if any generation worker has died."""
    for k, (worker, _) in enumerate(workers):
        if not worker.is_alive():
            raise SystemExit(f"generation worker {k} (pid {worker.pid}) died with exit code {worker.exitcode}: "
                             f"see its log above")


def stop_workers(workers, grace=10):
    """Ask the workers to finish; one that has not within `grace` s (busy starting vLLM, say) gets SIGTERM,
    and SIGKILL `grace` s later. A second Ctrl-C or SIGTERM cuts the waits short and kills at once (else the
    interpreter's exit would wait for them, unbounded)."""
    if workers:
        workers[0][1].stop.set()  # one event for all
    try:
        join_all(workers, grace)
        for worker, _ in workers:
            if worker.is_alive():
                worker.terminate()
        join_all(workers, grace)
    finally:
        for worker, _ in workers:
            if worker.is_alive():
                worker.kill()
                worker.join(timeout=10)


def join_all(workers, seconds):
    deadline = time.time() + seconds
    for worker, _ in workers:
        worker.join(timeout=max(deadline - time.time(), 0))


def wait_for_vllm(workers, cfg, say=print):
    """Before the trainer loads its model: where a worker's vLLM shares a GPU with this trainer (or always,
    with --startup_order vllm_first), wait until every worker has vLLM up. vLLM sizes its KV cache from how
    much free memory the whole GPU loses while it profiles, and fails if free memory rose meanwhile: the
    trainer's DeepSpeed start-up, which allocates and frees, must not run beside it. Says so every
    10 s; stops the run after cfg.startup_timeout. The ready messages go back on the status queue."""
    order = cfg.startup_order
    if order not in ("auto", "vllm_first", "together"):
        raise SystemExit(f"unknown --startup_order {order!r}: use auto, vllm_first or together")
    if not workers or order == "together" or (order == "auto" and not any(c.shares_gpu for _, c in workers)):
        return
    status, started, taken, said = workers[0][1].status, time.time(), [], -10.0
    why = "vLLM shares this trainer's GPU and measures its free memory" if order == "auto" else "--startup_order vllm_first"
    while sum(kind == "ready" for kind, _ in taken) < len(workers):
        waited = time.time() - started
        if waited > cfg.startup_timeout:
            raise SystemExit(f"vLLM did not start in {cfg.startup_timeout:.0f} s (--startup_timeout), and the trainer "
                             f"loads its model only once it has ({why}): see the generation worker's log above")
        if waited - said >= 10:
            say(f"waiting for the generation worker's vLLM to start before the trainer loads its model ({why}; "
                f"{waited:.0f} s, gives up after {cfg.startup_timeout:.0f} s)")
            said = waited
        check_workers(workers)
        try:
            taken.append(status.get(timeout=1.0))
        except queue.Empty:
            pass
    say(f"vLLM is up after {time.time() - started:.0f} s: the trainer loads its model now")
    for message in taken:
        status.put(message)


def draws_to_resume(state, workers):
    """A checkpoint's data position: the problem draws each worker had taken (older checkpoints: one number)."""
    draws = state["draws"] if isinstance(state["draws"], list) else [state["draws"]]
    if len(draws) != workers:
        raise SystemExit(f"the checkpoint was made with --gen_workers {len(draws)}: resume with the same number "
                         f"(each worker continues its own problem draws)")
    return draws


def take_local_group(groups_queue, waiting):
    """take_group's local twin (beta 0): the worker's next group; waiting(waited_s) runs while none is there."""
    start = time.time()
    while True:
        try:
            return groups_queue.get(timeout=1.0)
        except queue.Empty:
            waiting(time.time() - start)
