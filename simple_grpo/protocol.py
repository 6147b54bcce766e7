"""The wire between generators, the reference server and trainers: messages, client calls, the model check, the
server's flags. A message is safetensors bytes (tensors, JSON meta in the header): parsing runs no code (no pickle)."""
import glob
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass

import requests
import torch
from safetensors import safe_open
from safetensors.torch import load, save

from simple_grpo.flags import flag

VERSION = 2  # of the message format: a message of another version is refused
TOKEN_ENV = "SIMPLE_GRPO_TOKEN"  # the shared secret, when the server listens beyond loopback
DEFAULT_PORT = 59875
DEFAULT_REF_URL = f"http://127.0.0.1:{DEFAULT_PORT}"  # where `python ref_server.py` listens
FLOAT_TENSORS = ("rewards", "advantages", "sampler_logps")  # optional: what a group carries on to its trainer


def encode(tensors: dict, meta: dict) -> bytes:
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    return save(tensors, metadata={"json": json.dumps({"version": VERSION, **meta})})


def decode(body: bytes):
    """(tensors, meta) from encode's bytes; ValueError with a reason on anything else."""
    try:
        tensors = load(body)  # checks the header's length and every tensor's byte range against the body's
        meta = json.loads(json.loads(body[8:8 + int.from_bytes(body[:8], "little")])["__metadata__"]["json"])
    except Exception as e:  # noqa: BLE001 - any parse failure is the sender's error
        raise ValueError(f"not a valid message: {type(e).__name__}: {str(e)[:120]}") from None
    if not isinstance(meta, dict) or meta.get("version") != VERSION:
        raise ValueError(f"not a message of protocol version {VERSION}")
    return tensors, meta


def check_rollout(tensors, meta, vocab_size, max_len, max_group_size):
    """ValueError naming the problem unless this is a well-formed group (prompt_ids (P,), completion_ids (G, C))."""
    if not {"prompt_ids", "completion_ids"} <= set(tensors) <= {"prompt_ids", "completion_ids", *FLOAT_TENSORS}:
        raise ValueError(f"a group has prompt_ids, completion_ids and optionally {', '.join(FLOAT_TENSORS)}; "
                         f"got {sorted(tensors)[:8]}")
    prompt, completion = tensors["prompt_ids"], tensors["completion_ids"]
    if prompt.dim() != 1 or completion.dim() != 2 or prompt.numel() == 0 or completion.numel() == 0:
        raise ValueError(f"prompt_ids must be (P,) and completion_ids (G, C), none empty; got shapes "
                         f"{tuple(prompt.shape)} and {tuple(completion.shape)}")
    (G, C), P = completion.shape, prompt.numel()
    if G > max_group_size or P + C > max_len:
        raise ValueError(f"{G} completions, {P} + {C} tokens long: at most {max_group_size}, {max_len} tokens long")
    for name, t in (("prompt_ids", prompt), ("completion_ids", completion)):
        if t.dtype != torch.int64 or t.min() < 0 or t.max() >= vocab_size:
            raise ValueError(f"{name} must be int64 token ids in the vocabulary [0, {vocab_size}), got {t.dtype}")
    for name in FLOAT_TENSORS:
        t, shape = tensors.get(name), ((G, C) if name == "sampler_logps" else (G,))
        if t is not None and (t.dtype not in (torch.float32, torch.float64) or t.shape != shape
                              or not torch.isfinite(t).all()):
            raise ValueError(f"{name} must be finite float32/64 of shape {shape}, got {t.dtype} {tuple(t.shape)}")
    version, temperature = meta.get("policy_version", 0), meta.get("temperature", 1.0)
    if type(version) is not int or type(temperature) not in (int, float) or not 0 < temperature < math.inf:
        raise ValueError(f"policy_version must be an integer and temperature a positive number, got {version!r} "
                         f"and {temperature!r}")


# ---------------------------------------------------------------------------- the client side
def uses_ref_server(cfg):
    """Whether a trainer talks to the ref server: for the KL term (LoRA without --ref_url: its base), or to regroup."""
    return (cfg.beta != 0 and bool(cfg.ref_url)) or getattr(cfg, "regroup", False)


def ref_request(cfg, method, path, **kwargs):
    """One HTTP call to cfg.ref_url; no answer (nor 429, 5xx but 503) is retried for cfg.peer_timeout seconds."""
    token = cfg.ref_token or os.environ.get(TOKEN_ENV, "")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    first_failure, delay = None, 0.25
    while True:
        try:
            r = requests.request(method, cfg.ref_url + path, timeout=cfg.peer_timeout, headers=headers, **kwargs)
            if r.status_code == 401:
                raise SystemExit(f"ref server at {cfg.ref_url} refused our token: pass --ref_token or set "
                                 f"{TOKEN_ENV} to the server's")
            if r.status_code < 500 and r.status_code != 429 or r.status_code == 503:  # 429: as if down
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
    """Upload groups of rollouts [(tensors, meta)]; a full queue (503) is retried for up to cfg.ref_timeout s."""
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
    """This run's oldest finished group (tensors, meta), polled for (waiting(waited_s) between) until timeout s."""
    start, params = time.time(), {"wait": 2, "run_id": run_id, "policy_version": policy_version}  # None: not sent
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
    """The reference model's per-token log-probs of a batch's completions, (Q*G, C), from the ref server: each
    prompt's group is uploaded (the prompt unpadded, the completions cut after the group's longest: until_stop
    (Q*G, C) is 1 up to each one's first stop token), then taken back in order and padded back with 0.
    waiting(group, waited_s) runs while it waits."""
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


# ---------------------------------------------------------------------------- which model the server holds
def model_fingerprint(model):
    """{"token_table": hash of the tokenizer's token -> id table, "config": the config's fields, "weights": {tensor
    name: hash of its shape and first, middle, last rows in bfloat16} of its safetensors files ({} if none)}."""
    from huggingface_hub import snapshot_download
    from transformers import AutoConfig, AutoTokenizer
    vocab = sorted(AutoTokenizer.from_pretrained(model).get_vocab().items())
    config = AutoConfig.from_pretrained(model).to_dict()
    for field in ("dtype", "torch_dtype", "transformers_version", "_name_or_path", "use_cache"):
        config.pop(field, None)  # may differ between copies of one model: storage dtype, saver, path, a runtime switch
    directory = model if os.path.isdir(model) else snapshot_download(model, allow_patterns=["*.safetensors"])
    sums = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):  # pickled weights are never opened
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                tensor, shape = f.get_slice(name), f.get_slice(name).get_shape()
                rows = [tensor[i:i + 1] for i in sorted({0, shape[0] // 2, shape[0] - 1})] if len(shape) > 1 \
                    else [f.get_tensor(name)]
                sample = torch.cat([row.reshape(-1) for row in rows]).to(torch.bfloat16).view(torch.int16)
                sums[name] = hashlib.sha256(str(shape).encode() + sample.numpy().tobytes()).hexdigest()[:16]
    return {"token_table": hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16],
            "config": json.loads(json.dumps(config, default=str)),  # as /health sends it: int keys become strings
            "weights": sums}


def differences(ours, theirs):
    """What two fingerprints disagree on, in words: the token table, the config's fields, the weights (tensors
    whose checksum differs or that only one of them has; without safetensors files they cannot be compared)."""
    found = ["the token table differs"] if ours["token_table"] != theirs["token_table"] else []
    fields = sorted(key for key in ours["config"].keys() | theirs["config"].keys()
                    if ours["config"].get(key) != theirs["config"].get(key))
    if fields:
        found.append(f"the model config differs (fields {', '.join(fields)})")
    unread = [who for who, fingerprint in (("this run's model", ours), ("the server's model", theirs))
              if not fingerprint["weights"]]
    if unread:
        return found + [f"the weights cannot be compared: no safetensors files in {' or '.join(unread)} (pickled "
                        "weights are not opened; save_pretrained writes safetensors)"]
    names = ours["weights"].keys() | theirs["weights"].keys()
    if changed := sorted(name for name in names if ours["weights"].get(name) != theirs["weights"].get(name)):
        found.append(f"{len(changed)} of the {len(names)} tensors compared differ "
                     f"({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''})")
    return found


def check_reference(cfg):
    """Stop if the ref server serves another model than cfg.model, unless --beta 0 or --ref_model_differs_ok."""
    health = ref_request(cfg, "GET", "/health").json()
    if health.get("dtype") not in (None, cfg.dtype):
        print(f"note: the ref server computes the reference in {health['dtype']}, this run trains in {cfg.dtype}: "
              f"the KL term carries {health['dtype']}'s rounding (ref_server.py --dtype {cfg.dtype} to match)")
    theirs = health.get("fingerprint")
    if cfg.beta == 0 or theirs is None:  # no KL term, or a server that does not say what it serves
        return
    if not (differ := differences(model_fingerprint(cfg.model), theirs)):
        return
    what = (f"the ref server at {cfg.ref_url} serves {health.get('model')}, but this run starts from {cfg.model}: "
            + "; ".join(differ))
    if cfg.ref_model_differs_ok:
        print(f"note: {what} (--ref_model_differs_ok: going on)")
        return
    raise SystemExit(f"{what}. The KL term would pull the policy toward another model. Start the server with "
                     f"`python ref_server.py --model {cfg.model}`, or pass --ref_model_differs_ok if a different "
                     "reference is meant.")


# ----------------------------------------- regroup_ver/'s reference server's flags (ref_server.py's Config copies them)
@dataclass
class ServerConfig:
    model: str = flag("models/tiny-math", "the reference model (usually the policy's starting point)")
    host: str = flag("127.0.0.1", "the address to listen on: loopback only unless told otherwise")
    token: str = flag("", "shared secret every request must carry (default: $SIMPLE_GRPO_TOKEN); needed off loopback")
    port: int = flag(DEFAULT_PORT, "the port to listen on")
    device: str = flag("auto", "where the reference model runs: auto (the first visible GPU, else cpu), cpu, cuda:1")
    dtype: str = flag("auto", "auto (bfloat16 on a GPU, float32 on a CPU), float32, bfloat16 or float16")
    threads: int = flag(1, "CPU threads for the reference forward pass")
    max_queue: int = flag(256, "groups waiting in each direction; /upload answers 503 when full")
    max_queue_mb: int = flag(512, "... or when the uploads held in the queues pass this many MB")
    max_body_mb: int = flag(16, "the largest upload, in MB")
    max_group_size: int = flag(256, "the most completions in one group")
    max_connections: int = flag(64, "connections served at once; more get 429 and are closed")
    conn_timeout: float = flag(60.0, "seconds a connection may stay open: slow or stalled senders are cut off")
