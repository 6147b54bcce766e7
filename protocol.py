"""The wire format between generators, the reference server and trainers: no pickle.

A message is safetensors bytes: named tensors plus a small JSON dict in the safetensors
header's metadata. safetensors parses nothing but a JSON header and raw numbers, so
bytes from the network cannot run code (unlike torch.load / pickle).
"""
import json

import torch
from safetensors.torch import load, save

VERSION = 1


def encode(tensors: dict, meta: dict) -> bytes:
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    return save(tensors, metadata={"json": json.dumps({"version": VERSION, **meta})})


def decode(body: bytes):
    """(tensors, meta) from encode's bytes; ValueError with a reason on anything else."""
    if len(body) < 8:
        raise ValueError("body too short for a safetensors message")
    header_len = int.from_bytes(body[:8], "little")
    if header_len > len(body) - 8:
        raise ValueError(f"header of {header_len} bytes declared, {len(body) - 8} sent")
    try:
        header = json.loads(body[8:8 + header_len])
        meta = json.loads(header["__metadata__"]["json"])
        tensors = load(body)
    except Exception as e:  # noqa: BLE001 - any parse failure is the sender's error
        raise ValueError(f"not a valid message: {type(e).__name__}: {str(e)[:120]}") from None
    if not isinstance(meta, dict) or meta.get("version") != VERSION:
        raise ValueError(f"protocol version {meta.get('version') if isinstance(meta, dict) else None} "
                         f"!= {VERSION}")
    return tensors, meta


def check_rollout(tensors, meta, vocab_size, max_len):
    """Raise ValueError naming the problem unless this is a well-formed group of rollouts:
    prompt_ids (P,), completion_ids (G, C) int64 in the vocabulary, rewards and advantages
    (G,) finite floats, optional old_logps (G, C)."""
    need = {"prompt_ids": 1, "completion_ids": 2, "rewards": 1, "advantages": 1}
    for name, ndim in need.items():
        if name not in tensors:
            raise ValueError(f"missing tensor {name!r}")
        if tensors[name].dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(tensors[name].shape)}")
    prompt, completion = tensors["prompt_ids"], tensors["completion_ids"]
    G = completion.size(0)
    for name in ("prompt_ids", "completion_ids"):
        t = tensors[name]
        if t.dtype != torch.int64:
            raise ValueError(f"{name} must be int64, got {t.dtype}")
        if t.numel() and (t.min() < 0 or t.max() >= vocab_size):
            raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab_size})")
    if G == 0 or prompt.numel() == 0 or completion.size(1) == 0:
        raise ValueError("empty prompt or completions")
    if prompt.numel() + completion.size(1) > max_len:
        raise ValueError(f"prompt + completion = {prompt.numel() + completion.size(1)} tokens > {max_len}")
    for name in ("rewards", "advantages"):
        t = tensors[name]
        if not t.is_floating_point() or t.numel() != G or not torch.isfinite(t).all():
            raise ValueError(f"{name} must be {G} finite floats")
    if "old_logps" in tensors and tensors["old_logps"].shape != completion.shape:
        raise ValueError(f"old_logps shape {tuple(tensors['old_logps'].shape)} != completion_ids {tuple(completion.shape)}")
    if not isinstance(meta.get("policy_version", 0), int):
        raise ValueError("policy_version must be an integer")
