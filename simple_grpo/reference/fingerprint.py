"""Which model a reference server serves: a fingerprint its trainers compare with their own starting model.

The server's /health carries model_fingerprint(its --model); check_reference(cfg), called by both trainers
before their first step, computes the fingerprint of cfg.model and stops the run, naming both models, where
they differ: a reference of another size or vocabulary fails later with a 400, one with the same vocabulary
(another checkpoint, base vs instruct) gives a silently wrong KL term. --ref_model_differs_ok says it is meant.

A fingerprint is read from the model's files, not from loaded weights, so a checkpoint has the same one on
any device and in any dtype: the config's essentials, the vocabulary (its size and a hash of the tokenizer's
token -> id table), and a checksum of a few rows of the tensors outside the layers and of the first and last
layer, rounded to bfloat16 (an fp32 checkpoint and its bf16 copy agree).
"""
import glob
import hashlib
import json
import os
import re

import torch

CONFIG_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "vocab_size", "tie_word_embeddings")


def digest(value):
    """A short hex hash of anything JSON can write, or of bytes."""
    data = value if isinstance(value, bytes) else json.dumps(value, sort_keys=True).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def local_dir(model):
    """The model's directory: itself, or a hub name's snapshot (its config, tokenizer and safetensors files)."""
    if os.path.isdir(model):
        return model
    from huggingface_hub import snapshot_download
    return snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])


def weight_checksums(directory, layers):
    """{tensor name: checksum} of the tensors outside the layers and those of layers 0 and layers-1, each
    from its first, middle and last rows (all of a 1-D tensor), rounded to bfloat16. {} without safetensors files."""
    from safetensors import safe_open
    sums = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                layer = re.search(r"\.(\d+)\.", name)
                if layer is not None and int(layer.group(1)) not in (0, layers - 1):
                    continue
                tensor, shape = f.get_slice(name), f.get_slice(name).get_shape()
                parts = [tensor[i:i + 1] for i in sorted({0, shape[0] // 2, shape[0] - 1})] if len(shape) > 1 \
                    else [f.get_tensor(name)]
                sample = torch.cat([p.reshape(-1) for p in parts]).to(torch.bfloat16)
                sums[name] = digest(sample.view(torch.int16).numpy().tobytes())
    return sums


def model_fingerprint(model):
    """{"config": essentials, "vocab": {"size", "hash"}, "weights": {name: checksum}, "id": a hash of it all}."""
    from transformers import AutoConfig, AutoTokenizer
    directory = local_dir(model)
    config = AutoConfig.from_pretrained(directory).to_dict()
    vocab = AutoTokenizer.from_pretrained(directory).get_vocab()
    fingerprint = {"config": {key: config.get(key) for key in CONFIG_KEYS},
                   "vocab": {"size": len(vocab), "hash": digest(sorted(vocab.items()))},
                   "weights": weight_checksums(directory, config.get("num_hidden_layers") or 0)}
    return {**fingerprint, "id": digest(fingerprint)}


def differences(ours, theirs):
    """What differs between two fingerprints, in words ([] if they are the same model)."""
    found = [f"config {key}: {theirs['config'].get(key)} vs {ours['config'].get(key)}"
             for key in CONFIG_KEYS if ours["config"].get(key) != theirs["config"].get(key)]
    if ours["vocab"] != theirs["vocab"]:
        found.append(f"vocabulary: {theirs['vocab']['size']} tokens (hash {theirs['vocab']['hash']}) vs "
                     f"{ours['vocab']['size']} (hash {ours['vocab']['hash']})")
    common = sorted(set(ours["weights"]) & set(theirs["weights"]))
    changed = [name for name in common if ours["weights"][name] != theirs["weights"][name]]
    if changed:
        found.append(f"weights: {len(changed)} of the {len(common)} tensors compared differ ({', '.join(changed[:3])}"
                     + (", ..." if len(changed) > 3 else "") + ")")
    elif not common and ours["weights"] and theirs["weights"]:
        found.append("weights: no tensor name in common")
    return found


def check_reference(cfg):
    """Fail fast if the ref server does not answer (protocol.ref_request says so), and stop if it serves another
    model than cfg.model, naming both, unless cfg.ref_model_differs_ok. Notes a dtype that differs."""
    from simple_grpo.protocol import ref_request
    health = ref_request(cfg, "GET", "/health").json()
    served, theirs = health.get("model", "?"), health.get("fingerprint")
    if health.get("dtype") not in (None, cfg.dtype):
        print(f"note: the ref server computes the reference in {health['dtype']}, this run trains in {cfg.dtype}: "
              f"the KL term carries {health['dtype']}'s rounding (ref_server.py --dtype {cfg.dtype} to match)")
    if cfg.beta == 0 or theirs is None:  # no KL term; or a server that does not say what it serves
        return
    ours = model_fingerprint(cfg.model)
    found = differences(ours, theirs)
    if not found:
        return
    what = (f"the ref server at {cfg.ref_url} serves {served} (fingerprint {theirs['id']}), but this run starts "
            f"from {cfg.model} (fingerprint {ours['id']}): " + "; ".join(found))
    if cfg.ref_model_differs_ok:
        print(f"note: {what} (--ref_model_differs_ok: going on)")
        return
    raise SystemExit(f"{what}. The KL term would pull the policy toward another model. Start the server with "
                     f"`python ref_server.py --model {cfg.model}`, or pass --ref_model_differs_ok if a different "
                     "reference is meant.")
