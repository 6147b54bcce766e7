"""LoRA (--use_peft): a frozen base model plus low-rank adapters (PEFT), and only the adapters train.

Each adapted linear layer computes W x + (lora_alpha / lora_r) * B A x, B starting at zero, so step 0's policy is
the base model. With its adapters off the policy is the base exactly: the KL term's reference needs no second
copy (trainer/update.py's reference_logps). vLLM samples with the adapters merged into the weights it holds,
each merged weight made as the weight sync copies it (merged_weights).
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
    """The policy's weights in the groups the weight sync takes one at a time: [(parameters, weights)], a group per
    submodule (a LoRA layer's adapters among its parameters, not its weights); weights: [(name, tensor,
    lora_layer)], name a plain HF model's, tensor the module's own (ZeRO-3: a shard until gathered), lora_layer
    the PEFT layer whose adapters merge into it, else None."""
    groups = {}  # the group's module name: (parameters, weights)
    for key, tensor in module.state_dict(keep_vars=True).items():
        owner = key.rpartition(".")[0]  # the submodule that holds it
        for part in (".base_layer.", ".lora_"):  # PEFT: q_proj.base_layer.weight, q_proj.lora_A.default.weight
            if part in key:
                owner = key.split(part)[0]  # the LoRA layer, q_proj
                break
        parameters, weights = groups.setdefault(owner, ([], []))
        if isinstance(tensor, torch.nn.Parameter):
            parameters.append(tensor)
        if ".lora_" in key:
            continue  # an adapter: merged into its layer's weight, not sent
        lora_layer = module.get_submodule(owner) if key.endswith(".base_layer.weight") else None
        weights.append((key.removeprefix("base_model.model.").replace(".base_layer.", "."), tensor, lora_layer))
    return list(groups.values())


def merged(lora_layer, weight):
    """W + (lora_alpha / lora_r) * B @ A for each of the layer's active adapters: a new tensor (PEFT's
    get_delta_weight makes the scaled B @ A, freed once it is added)."""
    for adapter in lora_layer.active_adapters:
        weight = weight + lora_layer.get_delta_weight(adapter).to(weight.dtype)
    return weight


def merged_weights(module, gather=contextlib.nullcontext):
    """The policy's weights, one (name, tensor) at a time, under a plain HF model's names: the module's own tensors,
    and with LoRA each adapted weight merged, made only when asked for (a caller that copies each and lets it go
    holds one merged weight at a time). gather(parameters) holds a group whole while its weights are taken."""
    for parameters, weights in weight_groups(module):
        with gather(parameters):
            for name, tensor, lora_layer in weights:
                yield name, (tensor.detach() if lora_layer is None else merged(lora_layer, tensor.detach()))


def merged_shapes(module):
    """What merged_weights(module) yields, known before anything is merged or gathered: {name: (dtype, shape,
    first)}, first the name the same tensor came under first (tied: lm_head.weight is model.embed_tokens.weight).
    Under ZeRO-3 a parameter's whole shape is its ds_shape."""
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
