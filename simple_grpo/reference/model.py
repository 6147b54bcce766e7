"""The frozen reference model, loaded once (its log-probs of a group: logprobs.py's reference_group_logps)."""
import os

import torch

from simple_grpo.devices import auto_device, auto_dtype
from simple_grpo.protocol import TOKEN_ENV
from simple_grpo.reference.http_server import is_loopback


def load_model(cfg):
    """The frozen reference model, after refusing an exposed address without a token. cfg.device and
    cfg.dtype "auto" are resolved here (the first visible GPU in bf16, else the CPU in fp32)."""
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

