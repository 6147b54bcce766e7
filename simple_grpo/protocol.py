"""The wire between generators, the reference server and trainers: messages, checks, client calls, and the
server's own flags (ServerConfig: ref_server.py's; regroup_ver/'s server extends them).

A message is safetensors bytes: named tensors plus a small JSON dict in the safetensors
header's metadata. safetensors parses nothing but a JSON header and raw numbers, so bytes
from the network cannot run code (unlike torch.load / pickle). The server checks every
upload (check_rollout) before it touches its model; clients retry with backoff and stop
with an error naming the server when it is gone (ref_request).
"""
import json
import math
import os
import time
from dataclasses import dataclass

import requests
import torch
from safetensors.torch import load, save

from simple_grpo.flags import flag

VERSION = 2  # 2: vLLM's log-probs travel as sampler_logps (1 called them old_logps)
TOKEN_ENV = "SIMPLE_GRPO_TOKEN"  # the shared secret, when the server listens beyond loopback
DEFAULT_PORT = 59875
DEFAULT_REF_URL = f"http://127.0.0.1:{DEFAULT_PORT}"  # where `python ref_server.py` listens
ROLLOUT_TENSORS = {"prompt_ids": 1, "completion_ids": 2}  # name: ndim; all the reference model reads
# what a generator's group carries on to the trainer that takes it (grpo_vllm_one.py: the server is its queue;
# regroup_ver/'s server pools answers by reward); grpo_train.py keeps its own and sends only the tokens
OPTIONAL_TENSORS = {"rewards": 1, "advantages": 1, "sampler_logps": 2}


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
        tensors = load(body)  # checks every tensor's byte range against the body's length
    except Exception as e:  # noqa: BLE001 - any parse failure is the sender's error
        raise ValueError(f"not a valid message: {type(e).__name__}: {str(e)[:120]}") from None
    if not isinstance(meta, dict) or meta.get("version") != VERSION:
        raise ValueError(f"protocol version {meta.get('version') if isinstance(meta, dict) else None} "
                         f"!= {VERSION}")
    return tensors, meta


def check_rollout(tensors, meta, vocab_size, max_len, max_group_size):
    """Raise ValueError naming the problem unless this is a well-formed group of rollouts:
    prompt_ids (P,) and completion_ids (G, C) int64 in the vocabulary, P + C <= max_len,
    optional rewards and advantages (G,) and sampler_logps (G, C) (NO_LOGP where vLLM gave none), finite floats,
    meta with an integer policy_version and a positive finite temperature."""
    unknown = set(tensors) - set(ROLLOUT_TENSORS) - set(OPTIONAL_TENSORS)
    if unknown:
        raise ValueError(f"unexpected tensor(s) {sorted(unknown)[:5]}")
    for name, ndim in {**ROLLOUT_TENSORS, **OPTIONAL_TENSORS}.items():
        if name not in tensors:
            if name in OPTIONAL_TENSORS:
                continue
            raise ValueError(f"missing tensor {name!r}")
        if tensors[name].dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(tensors[name].shape)}")
    prompt, completion = tensors["prompt_ids"], tensors["completion_ids"]
    G = completion.size(0)
    if G == 0 or prompt.numel() == 0 or completion.size(1) == 0:
        raise ValueError("empty prompt or completions")
    if G > max_group_size:
        raise ValueError(f"{G} completions in a group > {max_group_size}")
    if prompt.numel() + completion.size(1) > max_len:
        raise ValueError(f"prompt + completion = {prompt.numel() + completion.size(1)} tokens > {max_len}")
    for name in ("prompt_ids", "completion_ids"):
        t = tensors[name]
        if t.dtype != torch.int64:
            raise ValueError(f"{name} must be int64, got {t.dtype}")
        if t.min() < 0 or t.max() >= vocab_size:
            raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab_size})")
    for name in ("rewards", "advantages", "sampler_logps"):
        if name not in tensors:
            continue
        t, shape = tensors[name], ((G,) if name != "sampler_logps" else tuple(completion.shape))
        if t.dtype not in (torch.float32, torch.float64) or tuple(t.shape) != shape:
            raise ValueError(f"{name} must be float32/64 of shape {shape}, got {t.dtype} {tuple(t.shape)}")
        if not torch.isfinite(t).all():
            raise ValueError(f"{name} has NaN or infinite values")
    version, temperature = meta.get("policy_version", 0), meta.get("temperature", 1.0)
    if not isinstance(version, int) or isinstance(version, bool):
        raise ValueError("policy_version must be an integer")
    if not isinstance(temperature, (int, float)) or not (0 < temperature < math.inf):
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")


# ---------------------------------------------------------------------------- the client side
def uses_ref_server(cfg):
    """Whether a trainer talks to the reference server: for the KL term's reference log-probs (with LoRA
    and no --ref_url the trainer's own base model, adapters off, gives them), and for regrouping's pools."""
    return (cfg.beta != 0 and bool(cfg.ref_url)) or getattr(cfg, "regroup", False)


def auth_headers(token):
    return {"Authorization": f"Bearer {token}"} if token else {}


def ref_request(cfg, method, path, **kwargs):
    """One HTTP call to the reference server at cfg.ref_url. A server that does not answer
    (refused, reset, timed out, 429, 5xx other than 503) is retried with backoff for cfg.peer_timeout
    seconds; then the run stops with an error that names it and says how to restart it."""
    token = cfg.ref_token or os.environ.get(TOKEN_ENV, "")
    first_failure, delay = None, 0.25
    while True:
        try:
            r = requests.request(method, cfg.ref_url + path, timeout=cfg.peer_timeout,
                                 headers=auth_headers(token), **kwargs)
            if r.status_code == 401:
                raise SystemExit(f"ref server at {cfg.ref_url} refused our token: pass --ref_token or set "
                                 f"{TOKEN_ENV} to the server's")
            too_many_connections = r.status_code == 429  # retried like a server that is down
            if not too_many_connections and (r.status_code < 500 or r.status_code == 503):
                return r
            problem = f"HTTP {r.status_code} {r.text[:100]}"
        except requests.RequestException as e:
            problem = type(e).__name__
        first_failure = first_failure or time.time()
        if time.time() - first_failure > cfg.peer_timeout:
            raise SystemExit(f"ref server at {cfg.ref_url} has not answered for {cfg.peer_timeout:.0f} s "
                             f"({problem}): is `python ref_server.py` running? Restart it, then rerun "
                             f"with --resume to continue from the last checkpoint")
        time.sleep(delay)
        delay = min(2 * delay, 4.0)


def post_groups(cfg, groups):
    """Upload groups of rollouts [(tensors, meta)] for the server to add ref_logps to. A full
    queue (503) is retried with backoff for up to cfg.ref_timeout seconds."""
    for tensors, meta in groups:
        body, deadline, delay = encode(tensors, meta), time.time() + cfg.ref_timeout, 0.05
        while (r := ref_request(cfg, "POST", "/upload", data=body)).status_code == 503:
            if time.time() > deadline:
                raise SystemExit(f"ref server at {cfg.ref_url} stayed full for {cfg.ref_timeout:.0f} s: "
                                 f"is anything taking its batches?")
            time.sleep(delay)
            delay = min(2 * delay, 2.0)
        if r.status_code != 200:
            raise SystemExit(f"ref server refused a group: HTTP {r.status_code} {r.text[:200]}")


def take_group(cfg, run_id, timeout, waiting=None, policy_version=None):
    """The oldest finished group (tensors, meta) of this run from the server (FIFO), waiting for one.
    Groups another run left in the server are skipped. waiting(waited_s) runs between polls: it
    tells the user what the wait is for, and may stop it (a dead producer, its own deadline).
    timeout: seconds before the run stops (None: waiting() keeps the deadline). policy_version: the
    trainer's (the regrouping server serves no answer too much older)."""
    start = time.time()
    params = {"wait": 2, "run_id": run_id}  # the server keeps other runs' (and other ranks') groups for them
    if policy_version is not None:
        params["policy_version"] = policy_version
    while True:
        r = ref_request(cfg, "GET", "/get", params=params)
        if r.status_code == 200:
            tensors, meta = decode(r.content)
            if meta.get("run_id") == run_id:
                return tensors, meta
            print(f"skipped a group of another run ({meta.get('run_id')}) left in the ref server")
        elif r.status_code != 204:
            raise SystemExit(f"ref server answered /get with HTTP {r.status_code} {r.text[:200]}")
        if waiting is not None:
            waiting(time.time() - start)
        if timeout is not None and time.time() - start > timeout:
            raise SystemExit(f"ref server at {cfg.ref_url} returned no finished group in {timeout:.0f} s: "
                             f"is it still working? (see its log)")


def reference_logps_from_server(cfg, run_id, prompt_ids, prompt_mask, completion_ids, until_stop, meta, waiting=None):
    """The reference model's per-token log-probs of a batch's completions, (Q*G, C), from the ref server:
    the same numbers as grpo_math.completion_logps of the frozen reference model in evaluation mode, in
    the server's --dtype (tests/test_ref_server.py). Each prompt's group goes as one upload (the prompt
    without its padding, the completions cut after the group's longest: until_stop (Q*G, C) is 1 up to
    each one's first stop token); then the Q answers are taken back, first in, first out (take_group polls
    for each until it is ready), and padded back to (Q*G, C) with 0. waiting(group, waited_s) runs while it waits."""
    Q, G = prompt_ids.size(0), completion_ids.size(0) // prompt_ids.size(0)
    groups = []
    for q in range(Q):
        rows, C = slice(q * G, (q + 1) * G), int(until_stop[q * G:(q + 1) * G].sum(1).max())
        groups.append(({"prompt_ids": prompt_ids[q][prompt_mask[q].bool()], "completion_ids": completion_ids[rows, :C]},
                       meta))
    post_groups(cfg, groups)
    ref_logps = torch.zeros(completion_ids.shape)
    for q, (sent, _) in enumerate(groups):
        got, _ = take_group(cfg, run_id, cfg.ref_timeout, waiting and (lambda waited_s: waiting(q, waited_s)))
        if not torch.equal(got["completion_ids"], sent["completion_ids"].cpu()):
            raise SystemExit(f"the ref server answered group {q} of this batch with another group's tokens: is a "
                             "second trainer using this run's id?")
        ref_logps[q * G:(q + 1) * G, :got["ref_logps"].size(1)] = got["ref_logps"]
    return ref_logps


# ---------------------------------------------------------------------------- the reference server's flags
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
