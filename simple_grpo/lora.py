"""LoRA (--use_peft): the policy is a frozen base model plus low-rank adapters, and only the adapters train.

Each adapted linear layer computes W x + (lora_alpha / lora_r) * B A x, with W frozen and A (r x in),
B (out x r) trained; B starts at zero, so step 0's policy is the base model exactly. PEFT does the
wrapping. Two things follow for GRPO:
- the reference model is free: the same model with its adapters switched off is the base, exactly as
  loaded, so the KL term needs no second copy of the weights and no reference server
  (trainer/update.py's reference_logps);
- gradients, Adam's moments and fp32 master weights exist only for A and B (the memory plan counts them).
vLLM samples with the adapters merged into the weights it already holds: the weight sync makes each merged
weight as it copies it (merged_weights; generation/weight_sync.py), so one merged copy exists at a time.
A checkpoint's step_N/ holds the adapters in PEFT's format; evaluate.py and tools/merge_lora.py make
a whole model of them.
"""
import contextlib
import json
import os

import torch


def target_modules(spec):
    """--lora_target_modules as PEFT takes it: None (PEFT's choice for the architecture), "all-linear",
    or a list of module names."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if not names:
        return None
    return "all-linear" if names == ["all-linear"] else names


def add_adapters(model, cfg):
    """The model wrapped by PEFT with fresh LoRA adapters; the base's weights are frozen."""
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=lora_dropout(cfg),
                        target_modules=target_modules(cfg.lora_target_modules), task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as e:  # e.g. a target module name the model does not have
        raise SystemExit(f"--use_peft: PEFT could not add the adapters ({e})") from None


def lora_dropout(cfg):
    """--lora_dropout, or its default: TRL's 0.05, and 0 under --disable_dropout."""
    if getattr(cfg, "disable_dropout", False):
        return 0.0
    return 0.05 if cfg.lora_dropout is None else cfg.lora_dropout


def weight_groups(module):
    """The policy's weights in the groups the weight sync takes one at a time: [(parameters, weights)], weights a
    list of (name, tensor, lora_layer). A group is a LoRA layer (its base weights, with its adapters among the
    parameters) or any other submodule's own tensors; name is what a plain HF model calls the tensor, tensor is the
    module's own (not a copy; under ZeRO-3 a shard until gathered), lora_layer the PEFT layer whose adapters merge
    into it, else None. The adapters themselves are in no group's weights: vLLM gets them merged."""
    from peft.tuners.lora import LoraLayer
    is_peft = hasattr(module, "peft_config")
    groups = {}  # the group's module name: (parameters, weights)
    for key, tensor in module.state_dict(keep_vars=True).items():
        owner = key.rpartition(".")[0]  # the submodule that holds it
        for part in (".base_layer.", ".lora_"):  # PEFT: q_proj.base_layer.weight, q_proj.lora_A.default.weight
            if is_peft and part in key:
                owner = key.split(part)[0]  # the LoRA layer, q_proj
                break
        parameters, weights = groups.setdefault(owner, ([], []))
        if isinstance(tensor, torch.nn.Parameter):
            parameters.append(tensor)
        if is_peft and ".lora_" in key:
            continue  # an adapter: merged into its layer's weight, not sent
        layer = module.get_submodule(owner)
        merges = isinstance(layer, LoraLayer) and key.endswith(".base_layer.weight")
        name = key.removeprefix("base_model.model.").replace(".base_layer.", ".") if is_peft else key
        weights.append((name, tensor, layer if merges else None))
    return list(groups.values())


def merged(lora_layer, weight):
    """W + (lora_alpha / lora_r) * B @ A for each of the layer's active adapters: a new tensor (PEFT's
    get_delta_weight makes the scaled B @ A, freed once it is added)."""
    for adapter in lora_layer.active_adapters:
        weight = weight + lora_layer.get_delta_weight(adapter).to(weight.dtype)
    return weight


def merged_weights(module, gather=contextlib.nullcontext):
    """The policy's weights, one (name, tensor) at a time, under the names a plain HF model has: the module's own
    tensors (no copy), and for a LoRA model (PEFT) each adapted weight merged, W + (lora_alpha / lora_r) * B @ A,
    made only when it is asked for: a caller that copies each one and lets it go holds one merged weight at a time.
    vLLM samples from these with no adapter support of its own. gather(parameters) holds each group's parameters
    whole while its weights are taken (ZeRO-3: deepspeed.zero.GatheredParameters, one group at a time)."""
    for parameters, weights in weight_groups(module):
        with gather(parameters):
            for name, tensor, lora_layer in weights:
                yield name, (tensor.detach() if lora_layer is None else merged(lora_layer, tensor.detach()))


def merged_shapes(module):
    """What merged_weights(module) yields, known before anything is merged or gathered: {name: (dtype, shape,
    first)}, first the name the same tensor came under first (tied weights: lm_head.weight is
    model.embed_tokens.weight), else the name itself. A merged weight has its base weight's dtype and shape and is
    a tensor of its own; under ZeRO-3 a parameter's whole shape is its ds_shape (it holds a shard)."""
    shapes, first = {}, {}  # first: id of a tensor -> the name it came under first
    for _, weights in weight_groups(module):
        for name, tensor, lora_layer in weights:
            came_first = name if lora_layer is not None else first.setdefault(id(tensor), name)
            shapes[name] = (tensor.dtype, tuple(getattr(tensor, "ds_shape", tensor.shape)), came_first)
    return shapes


def is_adapter_dir(path):
    """A LoRA checkpoint (PEFT's adapter_config.json) rather than a whole model."""
    return os.path.isfile(os.path.join(path, "adapter_config.json")) and not os.path.isfile(
        os.path.join(path, "config.json"))


def merge_adapter_dir(adapter_dir, out_dir, dtype=torch.float32):
    """Write the base model of adapter_dir with its adapters merged in, and its tokenizer, to out_dir:
    a whole HF model, for evaluate.py, vLLM or another trainer."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        base = json.load(f)["base_model_name_or_path"]
    if not os.path.isdir(base) and base.startswith(("models/", "runs/", ".", "/")):
        raise SystemExit(f"{adapter_dir}: its base model {base!r} is not here (run from the repository root, "
                         f"or edit base_model_name_or_path in adapter_config.json)")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=dtype), adapter_dir)
    model.merge_and_unload().save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(out_dir)
    return out_dir
