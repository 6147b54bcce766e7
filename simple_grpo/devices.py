"""Which device each process uses, and whether it has room: the generation worker's GPUs (physical ids, as
nvidia-smi numbers them, whatever CUDA_VISIBLE_DEVICES hides), the device of collective tensors, shared memory."""
import os
import shutil
import subprocess

import torch
import torch.distributed as dist


def physical_gpus():
    """The GPUs on this machine, [0, 1, ...] as nvidia-smi lists them ([] without one)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return list(range(sum(line.startswith("GPU ") for line in out.stdout.splitlines())))


def visible_gpus(physical, env=None):
    """The physical ids this process may use: CUDA_VISIBLE_DEVICES's list, or all of them."""
    value = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return list(physical)
    ids = [part.strip() for part in value.split(",") if part.strip()]
    if not all(part.isdigit() for part in ids):
        raise SystemExit(f"CUDA_VISIBLE_DEVICES={value!r}: name GPUs by number (as nvidia-smi does) for "
                         "--gen_device to work out which are free")
    return [int(part) for part in ids]


def physical_gpu(device):
    """The physical id of a torch device string here ("cuda" under CUDA_VISIBLE_DEVICES=7: 7), or None."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    try:
        visible = visible_gpus(physical_gpus())
    except SystemExit:
        return None
    index = device.index or 0
    return visible[index] if index < len(visible) else None


def generation_gpus(gen_device, gen_tp, trainer_gpus, physical, worker=0, workers=1, busy=()):
    """The physical GPU ids of generation worker `worker` (of `workers`), and whether it shares them
    with the trainer.

    gen_device >= 0: gen_tp GPUs from that physical id on (worker k: from gen_device + k * gen_tp).
    -1: the k-th gen_tp GPUs that no trainer rank of this node uses and that are not `busy` (the local
    reference server's), or, for a single worker where there are not enough (one GPU), the trainer's
    own: vLLM then takes only its --gen_memory share."""
    if gen_device >= 0:
        ids = list(range(gen_device + worker * gen_tp, gen_device + (worker + 1) * gen_tp))
    else:
        free = [g for g in physical if g not in trainer_gpus and g not in busy]
        if len(free) >= workers * gen_tp:
            ids = free[worker * gen_tp:(worker + 1) * gen_tp]
        elif workers == 1:
            ids = list(physical[:gen_tp])
        else:
            raise SystemExit(f"--gen_workers {workers} --gen_tp {gen_tp} needs {workers * gen_tp} GPUs that no trainer "
                             f"rank uses; this node has {len(free)} ({free}): each worker takes GPUs of its own")
    missing = [g for g in ids if g not in physical]
    if missing:
        listed = f"GPUs {physical[0]}-{physical[-1]}" if physical else "no GPU"
        raise SystemExit(f"--gen_device {gen_device} --gen_tp {gen_tp} needs GPU(s) {missing}, but nvidia-smi lists "
                         f"{listed} on this machine. --gen_device takes physical ids as nvidia-smi numbers them "
                         f"(the trainer uses {trainer_gpus})")
    return ids, any(g in trainer_gpus for g in ids)


def auto_device(device, cuda_available=None):
    """--device auto: "cuda" (the first visible GPU) where torch sees one, else "cpu"; any other value as given."""
    if device != "auto":
        return device
    cuda_available = torch.cuda.is_available() if cuda_available is None else cuda_available
    return "cuda" if cuda_available else "cpu"


def auto_dtype(dtype, device):
    """--dtype auto: bfloat16 on a GPU, float32 on a CPU (no bf16 units there: bf16 runs ~2x slower)."""
    if dtype != "auto":
        return dtype
    return "float32" if torch.device(device).type == "cpu" else "bfloat16"


def reference_gpus(ref_url, token="", timeout=5.0):
    """[the physical GPU] the reference server at ref_url reports in its /health, where that server runs on this
    machine (a loopback address) and on a GPU; [] otherwise, or if it does not answer in `timeout` seconds."""
    import requests
    from urllib.parse import urlparse
    host = urlparse(ref_url).hostname or ""
    if not ref_url or not (host == "localhost" or host.startswith("127.") or host == "::1"):
        return []
    try:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        gpu = requests.get(ref_url + "/health", timeout=timeout, headers=headers).json().get("gpu")
    except (requests.RequestException, ValueError):
        return []
    return [gpu] if isinstance(gpu, int) else []


def vllm_memory_share(gen_memory, shared_gpu):
    """vLLM's gpu_memory_utilization: --gen_memory when given, else 0.9 of a GPU of its own or 0.3 of one
    it shares with a trainer (or with anything else: the probe, a bench)."""
    return gen_memory or (0.3 if shared_gpu else 0.9)


def collective_device():
    """Where a tensor for a collective must live: the process group's own device type. NCCL takes
    only CUDA tensors (a CPU tensor stops the run), gloo takes CPU ones."""
    types = [d.type for d in getattr(dist.group.WORLD, "_device_types", [])]
    if not types:
        types = ["cuda"] if "nccl" in str(dist.get_backend()) else ["cpu"]
    if "cpu" in types:
        return torch.device("cpu")
    index = torch.cuda.current_device() if torch.cuda.is_available() else int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device(types[0], index)


def max_over_ranks(value):
    """The largest of the ranks' values, the same on every rank: they stop and save together."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    t = torch.tensor([float(value)], device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def sum_over_ranks(*values):
    """Each value summed over the ranks, the same on every rank, in one all-reduce (one rank: the values)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], device=collective_device(), dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def check_shared_memory(nbytes, path="/dev/shm"):
    """Stop with a clear message unless `path` has room for nbytes (the weight sync's two buffers)."""
    free = shutil.disk_usage(path).free
    if free < nbytes:
        need_gb = -(-nbytes // 2**30) + 1
        raise SystemExit(f"the weight sync needs {nbytes / 2**30:.2f} GB of shared memory in {path} (the model's "
                         f"weights, twice), but {free / 2**30:.2f} GB is free there. In a container, start it with "
                         f"a larger one (docker run --shm-size={need_gb}g ...), or free space in {path}")
