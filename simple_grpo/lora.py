"""LoRA (--use_peft): the policy is a frozen base model plus low-rank adapters, and only the adapters train.

Each adapted linear layer computes W x + (lora_alpha / lora_r) * B A x, with W frozen and A (r x in),
B (out x r) trained; B starts at zero, so step 0's policy is the base model exactly. PEFT does the
wrapping. Two things follow for GRPO:
- the reference model is free: the same model with its adapters switched off is the base, exactly as
  loaded, so the KL term needs no second copy of the weights and no reference server
  (trainer/update.py's reference_logps);
- gradients, Adam's moments and fp32 master weights exist only for A and B (the memory plan counts them).
vLLM samples with the adapters merged into the weights it already holds (generation/weight_sync.py).
A checkpoint's step_N/ holds the adapters in PEFT's format; evaluate.py and tools/merge_lora.py make
a whole model of them.
"""
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


def merged_weights(module):
    """The policy's weights under the names a plain HF model has: the module's state dict, or for a LoRA
    model (PEFT) the base's with each adapted weight merged, W + (lora_alpha / lora_r) * B @ A. vLLM samples
    from these with no adapter support of its own; the adapters themselves stay behind."""
    if not hasattr(module, "peft_config"):
        return module.state_dict()
    from peft.tuners.lora import LoraLayer
    weights = {key.removeprefix("base_model.model.").replace(".base_layer.", "."): t
               for key, t in module.state_dict().items() if ".lora_" not in key}
    for name, layer in module.named_modules():
        if isinstance(layer, LoraLayer):
            key = name.removeprefix("base_model.model.") + ".weight"
            delta = sum(layer.get_delta_weight(adapter) for adapter in layer.active_adapters)
            weights[key] = weights[key] + delta.to(weights[key].dtype)
    return weights


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
