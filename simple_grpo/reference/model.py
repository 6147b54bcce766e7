"""The frozen reference model: loaded once, then per-token log-probs added to each uploaded group."""
import os

import torch

from simple_grpo.devices import auto_device, auto_dtype
from simple_grpo.logprobs import sequence_logps
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


def add_ref_logps(model, tensors, meta, device):
    """tensors["ref_logps"] (G, C): the reference model's per-token log-probs of the completions."""
    prompt = tensors["prompt_ids"].to(device).unsqueeze(0)  # one prompt, G completions
    with torch.inference_mode():
        ref_logps = sequence_logps(model, prompt, torch.ones_like(prompt), tensors["completion_ids"].to(device),
                                   temperature=meta.get("temperature", 1.0))
    tensors["ref_logps"] = ref_logps.float().cpu()
