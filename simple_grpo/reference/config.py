"""The reference server's flags and the frozen model they name (ref_server.py; regroup_ver/ref_server_regroup.py
extends both): the server's whole set-up before it listens."""
import os
from dataclasses import dataclass

import torch

from simple_grpo.devices import auto_device, auto_dtype
from simple_grpo.flags import flag
from simple_grpo.protocol import DEFAULT_PORT, TOKEN_ENV
from simple_grpo.reference.http_server import is_loopback


@dataclass
class ServerConfig:
    model: str = flag("models/tiny-math", "the reference model (usually the policy's starting point)")
    host: str = flag("127.0.0.1", "the address to listen on: loopback only unless told otherwise")
    token: str = flag("", "shared secret every request must carry (default: $SIMPLE_GRPO_TOKEN); needed off loopback")
    port: int = flag(DEFAULT_PORT, "the port to listen on")
    device: str = flag("auto", "where the reference model runs: auto (the first visible GPU, else cpu), cpu, "
                               "cuda, cuda:1, ...")
    dtype: str = flag("auto", "auto (bfloat16 on a GPU, float32 on a CPU), float32, bfloat16 or float16")
    threads: int = flag(1, "CPU threads for the reference forward pass")
    max_queue: int = flag(256, "groups waiting in each direction; /upload answers 503 when full")
    max_queue_mb: int = flag(512, "... or when the uploads held in the queues pass this many MB")
    max_body_mb: int = flag(16, "the largest upload, in MB")
    max_group_size: int = flag(256, "the most completions in one group")
    max_connections: int = flag(64, "connections served at once; more get 429 and are closed")
    conn_timeout: float = flag(60.0, "seconds a connection may stay open: slow or stalled senders are cut off")


def load_model(cfg):
    """The frozen reference model, after refusing an exposed address without a token. cfg.device and
    cfg.dtype "auto" are resolved here (the first visible GPU in bf16, else the CPU in fp32). Its log-probs
    of a group: simple_grpo/logprobs.py's reference_group_logps."""
    cfg.token = cfg.token or os.environ.get(TOKEN_ENV, "")
    if not is_loopback(cfg.host) and not cfg.token:
        raise SystemExit(f"refusing to listen on {cfg.host} without a token: anyone who reaches it could feed "
                         f"the trainer. Set --token or {TOKEN_ENV} (trainers pass it as --ref_token).")
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(cfg.threads)
    cfg.device = auto_device(cfg.device)
    cfg.dtype = auto_dtype(cfg.dtype, cfg.device)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if cfg.dtype not in dtypes:
        raise SystemExit(f"unknown --dtype {cfg.dtype!r}: use auto, {', '.join(dtypes)}")
    dtype = dtypes[cfg.dtype]
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype).to(cfg.device).eval()
    return model.requires_grad_(False)
